"""`dflash2 bench` (also `dflash2-bench`): load a running server and write a JSON report.

    dflash2 bench --url http://127.0.0.1:8000 --concurrency 8 --duration 30 --output report.json
    dflash2 bench --url ... --sweep 1,4,16,64 --duration 20 --output sweep.json   # + sweep.png
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from dflash2.cli.args import add_flag


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="load-test a running server and report latency and throughput")
    add_bench_flags(parser)
    parser.set_defaults(func=run)


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    from dflash2.bench.client import ENDPOINTS

    add_flag(parser, "--url", default="http://127.0.0.1:8000", help="the server's base URL")
    add_flag(parser, "--endpoint", default="/v1/completions", choices=list(ENDPOINTS))
    add_flag(parser, "--dataset", default=None,
             help="jsonl: prompt or prompt_token_ids, max_tokens, optional priority (default: the shipped sample)")
    add_flag(parser, "--concurrency", type=int, default=8, help="requests in flight at most")
    add_flag(parser, "--request-rate", type=float, default=float("inf"),
             help="requests per second, Poisson arrivals (default: as fast as --concurrency allows)")
    add_flag(parser, "--num-prompts", type=int, default=None, help="send this many requests (cycling the dataset)")
    add_flag(parser, "--duration", type=float, default=None, help="send requests for this many seconds")
    add_flag(parser, "--timeout", type=float, default=60.0, help="seconds before one request counts as failed")
    add_flag(parser, "--max-tokens", type=int, default=None, help="override every dataset line's max_tokens")
    add_flag(parser, "--ignore-eos", action="store_true", help="generate max_tokens tokens for every request")
    add_flag(parser, "--model", default=None, help="the model field to send (default: the server's only model)")
    add_flag(parser, "--api-key", default=None)
    add_flag(parser, "--output", default=None, help="write the JSON report here")
    add_flag(parser, "--sweep", default=None, help="concurrency levels to run one after another, e.g. 1,4,16,64")
    add_flag(parser, "--chart", default=None, help="sweep chart PNG (default: the --output path with .png)")
    add_flag(parser, "--seed", type=int, default=0)
    add_flag(parser, "--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_flag(parser, "--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    from dflash2.bench.dataset import load_dataset
    from dflash2.bench.load import LoadConfig
    from dflash2.bench.report import format_summary

    if args.num_prompts is None and args.duration is None:
        args.duration = 30.0
    items = load_dataset(args.dataset, args.max_tokens)
    config = LoadConfig(url=args.url, endpoint=args.endpoint, concurrency=args.concurrency,
                        request_rate=args.request_rate, num_prompts=args.num_prompts, duration_s=args.duration,
                        timeout_s=args.timeout, model=args.model, api_key=args.api_key, ignore_eos=args.ignore_eos,
                        seed=args.seed, progress=args.progress)
    if args.sweep is not None:
        report = _sweep(args, config, items)
    else:
        report = _one_level(config, items)
        print(format_summary(report))
    if args.output is not None:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
        print(f"report written to {args.output}")
    return 0


def _one_level(config: Any, items: list[Any]) -> dict[str, Any]:
    from dflash2.bench.load import run_async, run_load
    from dflash2.bench.report import build_report

    return build_report(config, run_async(run_load(config, items)))


def _sweep(args: argparse.Namespace, config: Any, items: list[Any]) -> dict[str, Any]:
    from dflash2.bench.report import format_summary
    from dflash2.bench.sweep import find_knee, parse_levels, plot_sweep

    reports = []
    for level in parse_levels(args.sweep):
        report = _one_level(dataclasses.replace(config, concurrency=level), items)
        print(format_summary(report))
        reports.append(report)
    knee = find_knee(reports)
    chart = args.chart or (args.output.rsplit(".", 1)[0] + ".png" if args.output else "bench_sweep.png")
    plot_sweep(reports, knee, chart)
    print(f"knee at concurrency {knee}; chart written to {chart}")
    return {"sweep": reports, "knee_concurrency": knee, "chart": chart}


def main() -> None:
    """The `dflash2-bench` console script: `dflash2 bench` with the same flags."""
    from dflash2.cli.main import main as dflash2_main

    sys.exit(dflash2_main(["bench", *sys.argv[1:]]))
