"""`python -m islands_bench NAME [--quick ...]`: `islands bench` for a checkout on PYTHONPATH that is not
installed (no entry point to find; scripts/gpu-check runs the GPU benchmarks this way)."""

from __future__ import annotations

import argparse
import sys

from islands_bench.cli import add_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m islands_bench")
    add_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
