"""`dflash2 convert` (also `dflash2-convert`): quantize a checkpoint into a directory the engine serves."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dflash2.cli.args import add_flag

GROUP_FLAGS = {"embed": "--embed-quant", "qkv": "--qkv-quant", "o_proj": "--o-proj-quant", "ffn": "--ffn-quant",
               "lm_head": "--lm-head-quant", "experts": "--expert-quant"}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("convert", help="quantize a model (per tensor group, per layer)",
                                   description="Quantize an HF directory or GGUF file into a dflash2 directory.")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--model-path", "--model", "--model-dir", dest="model_path", default=None,
             help="HF directory or .gguf file (default: the bundled SmolLM2-135M)")
    add_flag(parser, "--output-path", "--output", "--output-dir", dest="output_path", required=True,
             help="directory to write")
    add_flag(parser, "--dtype", default=None,
             help="bits for every weight group unless set below: int8, int6, int4, bf16 (or 8, 6, 4, 16)")
    for group, flag in GROUP_FLAGS.items():
        add_flag(parser, flag, dest=f"{group}_quant", default=None, help=f"bits for {group}: 16, 8, 6 or 4"
                 + {"lm_head": " (default: --embed-quant's, else --dtype's)",
                    "experts": " (a mixture-of-experts layer's experts; default: --ffn-quant's; the router stays "
                               "16-bit)"}.get(group, ""))
    add_flag(parser, "--layer-quant", action="append", default=[],
             help="per-layer override LAYERS:GROUP=BITS[,GROUP=BITS] for qkv/o_proj/ffn/experts, e.g. 0-1:ffn=8 "
                  "(repeatable)")
    add_flag(parser, "--group-size", type=int, default=None,
             help="int4/int6 group size: 32, 64, 128 or 256 (default 128, or the largest of 128/64/32 dividing the row)")
    add_flag(parser, "--kv-quant", default=None, help="KV cache dtype recorded for serving: auto, bf16, fp16, fp8, int8, int4")
    add_flag(parser, "--kv-cache-dtype", default=None, help="same as --kv-quant (vLLM's spelling)")
    add_flag(parser, "--calibration-dataset", default=None,
             help='jsonl of texts ({"text": ...} a line): activation statistics for calibrated quantization')
    add_flag(parser, "--calibration-samples", type=int, default=64, help="texts to use from the dataset")
    add_flag(parser, "--calibration-max-tokens", "--max-seq-len", dest="calibration_max_tokens", type=int,
             default=512, help="tokens kept of each calibration text")
    add_flag(parser, "--num-gpus", type=int, default=1, help="conversion runs on one device: only 1 is accepted")
    add_flag(parser, "--overwrite", action="store_true", help="replace the output directory if it exists")
    add_flag(parser, "--no-progress", dest="progress", action="store_false", help="no progress bars")
    add_flag(parser, "--log-level", default="warning")
    parser.add_argument("--verbose", "-v", dest="log_level", action="store_const", const="info",
                        help="log progress (same as --log-level info)")


def quant_config_from_args(args: argparse.Namespace) -> Any:
    from dflash2.quantization.config import QuantConfig, parse_bits, parse_kv_dtype, parse_layer_override

    base = parse_bits(args.dtype, "--dtype") if args.dtype is not None else 16
    groups = {g: parse_bits(getattr(args, f"{g}_quant"), GROUP_FLAGS[g])
              for g in GROUP_FLAGS if getattr(args, f"{g}_quant") is not None}
    if "embed" in groups and "lm_head" not in groups:
        groups["lm_head"] = groups["embed"]  # the output projection follows the embedding (tied in many models)
    overrides: dict[int, dict[str, int]] = {}
    for spec in args.layer_quant:
        for layer, bits in parse_layer_override(spec).items():
            overrides.setdefault(layer, {}).update(bits)
    kv = [parse_kv_dtype(v, flag) for v, flag in ((args.kv_quant, "--kv-quant"), (args.kv_cache_dtype, "--kv-cache-dtype"))
          if v is not None]
    if len(set(kv)) > 1:
        raise ValueError(f"--kv-quant {args.kv_quant} and --kv-cache-dtype {args.kv_cache_dtype} disagree")
    if args.group_size is not None and args.group_size <= 0:
        raise ValueError(f"--group-size must be positive, got {args.group_size}")
    return QuantConfig.build(base, groups, overrides, group_size=args.group_size,
                             kv_cache_dtype=kv[0] if kv else "auto")


def run(args: argparse.Namespace) -> int:
    from dflash2.quantization.config import QuantConfig
    from dflash2.quantization.convert import ConvertOptions, convert

    if args.num_gpus != 1:
        raise ValueError(f"--num-gpus {args.num_gpus}: conversion runs on one device; only 1 is supported")
    quant = quant_config_from_args(args)
    options = ConvertOptions(model_path=args.model_path, output_path=args.output_path, quant=quant,
                             calibration_dataset=args.calibration_dataset,
                             calibration_samples=args.calibration_samples,
                             calibration_max_tokens=args.calibration_max_tokens,
                             overwrite=args.overwrite, progress=args.progress)
    summary = convert(options)
    q = summary["quantization"]
    print(f"wrote {summary['output_path']}: {QuantConfig.from_dict(q).describe()}; KV {q['kv_cache_dtype']}; "
          f"{summary['weight_bytes'] / 2**20:.1f} MiB of weights; calibration: {q['calibration']['method']}; "
          f"{summary['seconds']} s", file=sys.stderr)
    print(json.dumps({k: summary[k] for k in ("output_path", "weight_bytes", "seconds")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`dflash2-convert`: the same command on its own."""
    from dflash2.cli.main import main as dflash2_main

    return dflash2_main(["convert", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
