"""W2 latency: llama-3-8b (dummy bf16), one request, 128-token prompt, 256 new tokens.

    python3 benchmarks/latency.py [--peer-json peer_w2.json] [--save] [--weights bf16|int8|int4|int6]
Prints JSON: tok/s over the whole request (as the peer measures it), decode-only tok/s,
time-to-first-token, and the fraction of the weight-streaming roofline.
`--weights int4` quantizes the dummy weights (round-to-nearest, layer by layer as they are drawn) to a
QuantConfig with qkv, o_proj, ffn and lm_head at that width (group 128); the embedding stays bf16 (a decode
step reads one row of it). The roofline then counts the quantized bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import finish, sync  # noqa: E402
from benchmarks.kernel_times import exposed_table, kernel_events, kernel_table  # noqa: E402
from benchmarks.roofline import H200_BYTES_PER_S, weight_bytes  # noqa: E402
from dflash2 import LLM, SamplingParams  # noqa: E402
from dflash2.quantization.config import QuantConfig, parse_bits  # noqa: E402

WEIGHT_CHOICES = ("bf16", "int8", "int6", "int4")


def quantize_dummy_weights(weights: str) -> QuantConfig | None:
    """Make the engine load its dummy weights quantized (the Engine has no quantization option: its
    load_model is wrapped for this process). None for bf16."""
    if weights == "bf16":
        return None
    import dflash2.engine.model_setup as model_setup_module
    from dflash2.loading.model_loader import load_model

    config = QuantConfig.build(parse_bits(weights), group_bits={"embed": 16})
    model_setup_module.load_model = lambda *args, **kwargs: load_model(*args, quantization=config, **kwargs)
    return config


def streamed_weight_bytes(llm: LLM) -> int:
    """Bytes a decode step reads: every linear layer's stored tensors, the norms, one embedding row (ignored)."""
    module = llm.engine.model.module
    total = 0
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if not name.startswith("embed_tokens") and not name.startswith("rotary"):
            total += tensor.numel() * tensor.element_size()
    if getattr(module, "lm_head", None) is None:  # tied: the head streams the embedding
        total += sum(t.numel() * t.element_size() for t in module.embed_tokens.state_dict().values())
    return total


def one_request(llm: LLM, prompt: list[int], new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0)
    sync()
    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, params)
    first = None
    count = 0
    while engine.has_unfinished():
        for output in engine.step():
            count = len(output.outputs[0].token_ids)
            if first is None:
                first = time.perf_counter()
    total = time.perf_counter() - start
    return {"total_s": total, "ttft_s": first - start, "tokens": count}


def profile_decode(llm: LLM, prompt: list[int]) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0))
    for _ in range(10):
        engine.step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
        sync()
    events = kernel_events(prof)
    exposed, busy_us = exposed_table(events, 20)
    print(json.dumps({"busy_us_per_step": busy_us, "exposed": exposed[:25], "kernels": kernel_table(events, 20)[:25]},
                     indent=1), flush=True)
    while engine.has_unfinished():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--cuda-graph-max-prefill-tokens", type=int, default=2048,
                        help="0: the prompt's prefill runs eagerly (decode-only graphs)")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="print the top kernels of 20 decode steps, totals and exposed "
                             "(decode_profile.py has more)")
    parser.add_argument("--blas", default=None, help="torch.backends.cuda.preferred_blas_library: cublas or cublaslt")
    parser.add_argument("--weights", default="bf16", choices=WEIGHT_CHOICES,
                        help="dummy weights quantized to this width (all linear layers and lm_head; embedding bf16)")
    parser.add_argument("--peer-json", default=None)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    quant = quantize_dummy_weights(args.weights)
    llm = LLM(args.model, load_format="dummy", max_num_seqs=4, max_model_len=2048, max_num_batched_tokens=2048,
              enforce_eager=args.enforce_eager, overlap=False if args.no_overlap else None,
              enable_prefix_caching=False, cuda_graph_max_prefill_tokens=args.cuda_graph_max_prefill_tokens)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (args.prompt_len,), generator=generator).tolist()
    one_request(llm, prompt, 16)  # warm-up
    if args.profile:
        profile_decode(llm, prompt)
    runs = [one_request(llm, prompt, args.new_tokens) for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["total_s"])
    decode_s = best["total_s"] - best["ttft_s"]
    streamed = weight_bytes(llm.engine.model.arch) if quant is None else streamed_weight_bytes(llm)
    ceiling = H200_BYTES_PER_S / streamed
    tok_s = best["tokens"] / best["total_s"]
    result = {"workload": "w2", "engine": "dflash2", "model": args.model, "weights": args.weights,
              "quantization": None if quant is None else quant.to_dict(), "weight_bytes_per_step": streamed,
              "new_tokens": best["tokens"],
              "seconds": round(best["total_s"], 4), "tok_s": round(tok_s, 1),
              "decode_tok_s": round((best["tokens"] - 1) / decode_s, 1),
              "ttft_ms": round(best["ttft_s"] * 1e3, 2), "roofline_tok_s": round(ceiling, 1),
              "fraction_of_roofline": round(tok_s / ceiling, 3),
              "kv_pool_gib": round(llm.engine.runner.storage.pool_bytes.numel() / 2**30, 2),
              "cuda_graphs": llm.engine.runner.graphs is not None, "overlap": llm.engine.overlap,
              "cuda_graph_max_prefill_tokens": args.cuda_graph_max_prefill_tokens,
              "blas": str(torch.backends.cuda.preferred_blas_library()),
              "all_runs_s": [round(r["total_s"], 4) for r in runs]}
    finish(result, args.peer_json, args.save)


if __name__ == "__main__":
    main()
