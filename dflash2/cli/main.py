"""`dflash2` command: dispatches to the subcommands."""
from __future__ import annotations

import argparse
import sys

from dflash2.cli import bench, convert, generate, serve, top, validate
from dflash2.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash2", description="dflash2 LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(subparsers)
    serve.add_parser(subparsers)
    bench.add_parser(subparsers)
    convert.add_parser(subparsers)
    validate.add_parser(subparsers)
    top.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
