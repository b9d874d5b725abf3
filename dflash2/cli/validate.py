"""`dflash2 validate` (also `dflash2-validate`): what a model directory holds, what it costs, how good it is.

Prints a readable report (ERROR lines for real problems, WARNING lines for doubtful quality) and, with --output,
the same as JSON. Exits 1 when there is any ERROR: a broken file, or quality past the --error-* bounds, or an
empty or degenerate greedy answer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from dflash2.cli.args import add_flag


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("validate", help="check a (quantized) model against its reference",
                                   description="Check a model directory: formats, memory, quality, greedy text.")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--model-path", "--model", "--model-dir", dest="model_path", required=True,
             help="a model directory (as written by `dflash2 convert`)")
    add_flag(parser, "--reference-model", default=None,
             help="unquantized model to compare with (default: the source recorded in the config)")
    add_flag(parser, "--test-input", default="The capital of France is", help="prompt for the greedy text")
    add_flag(parser, "--max-new-tokens", type=int, default=32)
    add_flag(parser, "--eval-text", default=None, help="a text file to score (default: a built-in held-out text)")
    add_flag(parser, "--max-eval-tokens", type=int, default=1024)
    add_flag(parser, "--kv-cache-dtype", default=None, help="KV cache dtype for the engine, the perplexity and the memory figures (default: the config's)")
    add_flag(parser, "--context-tokens", type=int, default=1024, help="context length of the roofline step time")
    add_flag(parser, "--warn-perplexity-increase", type=float, default=10.0,
             help="WARNING above this perplexity increase against the reference, in percent (default 10)")
    add_flag(parser, "--warn-kl", type=float, default=0.05,
             help="WARNING above this mean KL divergence from the reference (default 0.05)")
    add_flag(parser, "--error-perplexity-increase", type=float, default=25.0,
             help="ERROR and exit 1 above this perplexity increase, in percent (default 25)")
    add_flag(parser, "--error-kl", type=float, default=0.25,
             help="ERROR and exit 1 above this mean KL divergence (default 0.25)")
    add_flag(parser, "--output", default=None, help="write the report as JSON here")
    add_flag(parser, "--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    from dflash2.quantization.config import parse_kv_dtype
    from dflash2.quantization.validate import QualityThresholds, ValidateOptions, validate

    eval_text = None
    if args.eval_text is not None:
        if not os.path.isfile(args.eval_text):
            raise ValueError(f"--eval-text {args.eval_text} does not exist")
        with open(args.eval_text, encoding="utf-8") as f:
            eval_text = f.read()
        if len(eval_text.split()) < 2:
            raise ValueError(f"--eval-text {args.eval_text} holds no text to score")
    kv = parse_kv_dtype(args.kv_cache_dtype, "--kv-cache-dtype") if args.kv_cache_dtype else None
    options = ValidateOptions(model_path=args.model_path, reference_model=args.reference_model,
                              test_input=args.test_input, max_new_tokens=args.max_new_tokens, eval_text=eval_text,
                              max_eval_tokens=args.max_eval_tokens, kv_cache_dtype=kv,
                              context_tokens=args.context_tokens,
                              thresholds=QualityThresholds(args.warn_perplexity_increase, args.warn_kl,
                                                           args.error_perplexity_increase, args.error_kl))
    report = validate(options)
    print_report(report)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if report["errors"] else 0


def print_report(report: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    print(f"model: {report['model_path']}", file=out)
    quant = report.get("quantization")
    if quant:
        print(f"quantization: embed {quant['embed_quant']} / qkv {quant['qkv_quant']} / o_proj {quant['o_proj_quant']}"
              f" / ffn {quant['ffn_quant']} / lm_head {quant['lm_head_quant']} bits, group size "
              f"{quant['group_size'] or 'auto'}, KV {quant['kv_cache_dtype']}, per-layer overrides "
              f"{quant['layers'] or 'none'}, calibration {(quant.get('calibration') or {}).get('method')}", file=out)
    _print_layers(report.get("layers"), out)
    for name, count in (report.get("kernels") or {}).items():
        print(f"kernel: {count:3d} x {name}", file=out)
    _print_memory(report.get("memory"), out)
    quality = report.get("quality")
    if quality:
        line = f"quality: perplexity {quality['perplexity']} over {quality['eval_tokens']} tokens"
        if quality.get("reference_perplexity") is not None:
            line += (f" (reference {quality['reference_perplexity']}, {quality['perplexity_change_pct']:+.2f}%), "
                     f"mean KL {quality['mean_kl_divergence']}")
        print(line, file=out)
    if report.get("greedy"):
        print(f"greedy: {report['greedy']['test_input']!r} -> {report['greedy']['text']!r}", file=out)
    for warning in report["warnings"]:
        print(f"WARNING: {warning}", file=out)
    for error in report["errors"]:
        print(f"ERROR: {error}", file=out)


def _print_layers(layers: dict[str, Any] | None, out: Any) -> None:
    if not layers:
        return
    print(f"embed: {layers['embed']}   lm_head: {layers['lm_head']}", file=out)
    for index, groups in layers.items():
        if isinstance(groups, dict):
            print(f"layer {index:>3}: " + "  ".join(f"{g} {f}" for g, f in groups.items()), file=out)


def _print_memory(memory: dict[str, Any] | None, out: Any) -> None:
    if not memory:
        return
    groups = ", ".join(f"{g} {b / 2**20:.1f}" for g, b in memory["weight_bytes_by_group"].items())
    print(f"weights: {memory['weight_bytes'] / 2**20:.1f} MiB ({groups} MiB)", file=out)
    print(f"KV cache: {memory['kv_cache_dtype']}, {memory['kv_bytes_per_token']:.0f} bytes/token, "
          f"{memory['kv_tokens_per_gib']} tokens per GiB", file=out)
    steps = ", ".join(f"{d} {ms} ms" for d, ms in memory["predicted_decode_step_ms"].items())
    print(f"roofline decode step at batch 1, {memory['roofline_context_tokens']} tokens of context: {steps}", file=out)


def main(argv: list[str] | None = None) -> int:
    """`dflash2-validate`: the same command on its own."""
    from dflash2.cli.main import main as dflash2_main

    return dflash2_main(["validate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
