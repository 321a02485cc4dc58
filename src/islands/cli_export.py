"""`islands export RUN_DIR OUT`: a run's global model and tokenizer in the Hugging Face format (islands.app.export)."""

from __future__ import annotations

import argparse
import json

from islands.app.export import ExportError, export
from islands.cli_more import UsageError

_SOURCES = {"checkpoint": "its checkpoint", "model": "the model it ended with"}


def cmd_export(args: argparse.Namespace) -> int:
    try:
        summary = export(args.run_dir, args.out, step=args.step, verify=args.verify)
    except ExportError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"exported {summary['model']} ({summary['parameters']:,} parameters, {summary['vocab']} tokens) from "
            f"step {summary['step']} of {args.run_dir} ({_SOURCES[summary['source']]}) to {summary['out']}"
        )
    return 0


def add_export_command(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's global model and tokenizer in the Hugging Face format",
        description="Write the global model of an hf-causal-lm run (under DiLoCo and the other outer "
        "strategies: the outer model) and its tokenizer to OUT, loadable with "
        "transformers' AutoModelForCausalLM.from_pretrained(OUT) (docs/hf-models.md). The model comes from the "
        "run's newest intact checkpoint when it has checkpoints, else from RUN_DIR/model, which every run "
        "writes when it ends.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory `islands train` wrote")
    p.add_argument("out", metavar="OUT", help="the directory to write; it must not exist")
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="the checkpoint step to export (default: the newest intact checkpoint, or the model the run ended with "
        "when it has none)",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip loading OUT back with transformers and comparing its logits before it is renamed",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(fn=cmd_export)
