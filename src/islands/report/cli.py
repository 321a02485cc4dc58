"""`islands report [RESULTS_DIR] OUT`: the argparse wiring; islands.cli calls add_report_command."""

from __future__ import annotations

import argparse
import sys

from islands.report.results import ReportError
from islands.report.site import build_site


def cmd_report(args) -> int:
    try:
        site = build_site(args.results_dir, args.out)
    except ReportError as e:
        print(f"islands: error: {e}", file=sys.stderr)
        return 2
    variants = sum(len(e.variants) for e in site.experiments)
    print(f"wrote {site.out}/index.html: {len(site.experiments)} experiments, {variants} result pages")
    return 0


def add_report_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "report",
        help="write a static HTML site of the bench results (open OUT/index.html)",
        description="Write a self-contained HTML site from the bench's results: an index of "
        "every practice and open question linked to its experiment, and one page per "
        "experiment with its headline, table, plot, interconnect, baseline and command.",
    )
    p.add_argument(
        "results_dir",
        nargs="?",
        default="results",
        metavar="RESULTS_DIR",
        help="the bench's results directory (default results)",
    )
    p.add_argument("out", metavar="OUT", help="directory to write the site into (replaced if an earlier report)")
    p.set_defaults(fn=cmd_report)
    return p
