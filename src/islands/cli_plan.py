"""`islands plan`: predicted step time, bytes and memory of each strategy for a job's model and links (islands.plan)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console

from islands.plan import DEFAULT_STRATEGIES, PlanError, plan
from islands.plan.report import plot, table


def _device(name: str | None) -> str:
    """The device to profile on: as `islands train` reads world.device (auto: the GPU when there is one)."""
    if name in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def add_plan_command(
    sub: argparse._SubParsersAction,
    add_config_flags: Callable[[argparse.ArgumentParser], None],
    config_of: Callable[[argparse.Namespace], object],
    error: type[Exception],
) -> None:
    p = sub.add_parser(
        "plan",
        help="predict step time, bytes and memory of each strategy for your model and links, before running",
        description="Profile one worker's step (cached), then predict every strategy's step time (compute and "
        "exposed communication), bytes inside and across islands, per-rank memory, and rank them; the job is "
        "given as for `islands train` (--task, --workers, --islands, ...).",
    )
    add_config_flags(p)
    p.add_argument(
        "--link",
        default="100mbit",
        help="the link between islands: RATE[,LATENCY] (100mbit, 1gbit,5ms), a testbed name, or measured",
    )
    p.add_argument("--inside-link", default="measured", help="the link between an island's workers (same forms)")
    p.add_argument(
        "--strategy",
        action="append",
        dest="strategies",
        metavar="SPEC",
        help="a strategy to consider, repeatable: ddp, zero1, fsdp or an outer spec (default: "
        f"{', '.join(DEFAULT_STRATEGIES)})",
    )
    p.add_argument("--budget-mb", type=float, default=0.0, help="per-rank memory budget; 0: no limit")
    p.add_argument("--plot", default="", help="write step time against cross-island bandwidth here (PNG)")
    p.add_argument("--json", dest="json_out", default="", help="write the whole plan as JSON here")
    p.add_argument("--refresh", action="store_true", help="profile again instead of reading the cache")

    def run(args: argparse.Namespace) -> int:
        try:
            cfg = config_of(args)
            result = plan(
                cfg,  # type: ignore[arg-type]
                link=args.link,
                inside_link=args.inside_link,
                strategies=tuple(args.strategies or DEFAULT_STRATEGIES),
                device=_device(getattr(args, "world.device", None)),
                budget_mb=args.budget_mb,
                refresh=args.refresh,
            )
        except PlanError as e:
            raise error(str(e)) from None
        console = Console(width=200)
        t = result.topology
        console.print(
            f"{t.workers} workers in {t.islands} island(s); between islands {result.cross.describe()}; "
            f"inside {result.inside.describe()}"
        )
        console.print(table(result.predictions, f"islands plan ({result.seconds:.1f} s, profiling included)"))
        best = result.best
        console.print(f"first choice: {best.label}")
        for name, value in best.inputs.items():
            console.print(f"  {name}: {value}")
        err = best.expected_error
        console.print(
            "  expected error (median/worst, planner-accuracy): "
            + ", ".join(f"{k} {m * 100:.0f}%/{w * 100:.0f}%" for k, (m, w) in err.items())
        )
        for c in result.crossovers:
            console.print(f"crossover at {c.rate_bps / 1e6:.3g} Mbit/s: {c.slower} -> {c.faster}")
        for note in result.notes + sorted({n for p in result.predictions for n in p.notes}):
            console.print(f"note: {note}")
        if args.plot:
            plot(result.curves, result.crossovers, args.plot, f"{t.workers} workers, {t.islands} islands")
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result.as_dict(), indent=1, default=str))
        return 0

    p.set_defaults(fn=run)
