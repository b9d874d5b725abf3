"""What quantized KV and weights cost in quality: perplexity and mean KL of the bundled SmolLM2-135M on a held-out
text, for the float model (`--dtype float32`: every tensor dequantized), the default load (the GGUF's Q4_1 tensors
as int4 groups of 32 and its Q8_0 embedding as int8 per row) and an int8-weight conversion, with each KV dtype. Prints JSON (CPU; a few minutes).

    .venv/bin/python benchmarks/kv_quant_quality.py [--text benchmarks/data/heldout.txt] [--max-tokens 2048]
                                                    [--int8-model DIR] [--kv fp32,int8,int4,fp8] [--output F]

The text (benchmarks/data/heldout.txt) was written for this measurement: no test, calibration set or training
corpus holds it. Scores come from one dense pass a model (quantization/scoring.py: K/V read back through the
KV format's own quantize -> dequantize, as the engine's pages hold them; a unit test ties it to the engine's own
prompt logprobs); KL is against the float model with float KV. Without --int8-model the bundled model is
converted with `--dtype int8` (round to nearest) into a temporary directory first.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_report  # noqa: E402
from dflash2.loading.model_loader import load_model  # noqa: E402
from dflash2.loading.tokenizer import bundled_model_path  # noqa: E402
from dflash2.quantization.scoring import log_probs, perplexity_and_kl  # noqa: E402

HELD_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "heldout.txt")


def convert_int8(directory: str) -> str:
    from dflash2.cli.main import main as dflash2_main

    out = os.path.join(directory, "int8")
    if dflash2_main(["convert", "--output-path", out, "--dtype", "int8", "--no-progress"]) != 0:
        raise SystemExit("the int8 conversion failed")
    return out


def score(path: str, token_ids: list[int], kv_dtypes: list[str], reference: torch.Tensor | None,
          reference_ppl: float | None, dtype: str = "float32") -> list[dict]:
    model = load_model(path, "auto", dtype, torch.device("cpu"), None)
    rows = []
    for kv in kv_dtypes:
        started = time.perf_counter()
        logprobs = log_probs(model.module, token_ids, None if kv == "fp32" else kv)
        ppl, kl = perplexity_and_kl(logprobs, token_ids, reference)
        row = {"kv_cache_dtype": kv, "perplexity": round(ppl, 4), "seconds": round(time.perf_counter() - started, 1)}
        if reference is not None:
            row |= {"perplexity_change_pct": round(100 * (ppl / reference_ppl - 1), 3), "mean_kl": round(kl, 6)}
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--text", default=HELD_OUT, help="text file to score (default: the held-out text)")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--int8-model", default=None, help="an int8-weight conversion of the bundled model")
    parser.add_argument("--kv", default="fp32,int8,int4,fp8", help="KV dtypes to score (fp32: float KV)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    kv_dtypes = args.kv.split(",")
    source = bundled_model_path()
    reference_model = load_model(source, "auto", "float32", torch.device("cpu"), None)
    token_ids = reference_model.tokenizer.encode(text)[:args.max_tokens]
    reference = log_probs(reference_model.module, token_ids)
    reference_ppl, _ = perplexity_and_kl(reference, token_ids)
    del reference_model
    with tempfile.TemporaryDirectory() as tmp:
        int8_model = args.int8_model or convert_int8(tmp)
        report = {"benchmark": "kv_quant_quality", "model": "SmolLM2-135M-Instruct Q4_1, dequantized (float32)",
                  "text": os.path.relpath(args.text), "tokens": len(token_ids),
                  "reference_perplexity": round(reference_ppl, 4), "date": time.strftime("%Y-%m-%d"),
                  "float_weights": score(source, token_ids, kv_dtypes, reference, reference_ppl),
                  "gguf_native_weights": score(source, token_ids, kv_dtypes, reference, reference_ppl, "auto"),
                  "int8_weights": score(int8_model, token_ids, kv_dtypes, reference, reference_ppl)}
    print_report(report, args.output)


if __name__ == "__main__":
    main()
