"""Structured output's cost (issue 48): decode throughput of N concurrent requests with a JSON schema against the
same requests unconstrained, offline LLM.generate, and whether the guided steps synchronize the host with the GPU
more often than the plain ones.

    python3 benchmarks/structured_output.py --tokenizer DIR [--model llama-3-8b] [--concurrency 16] [--output F]

The model is a preset's architecture with dummy weights and its vocabulary cut to the tokenizer's (a dummy
preset has no tokenizer, and xgrammar needs one): `--tokenizer DIR` names a directory with tokenizer.json, e.g.
the bundled model's, saved by `--save-bundled-tokenizer DIR`. The schema asks for one string of at least 100,000
characters, so no request's JSON can close before `--max-tokens`: both runs decode the same number of tokens and
every step of the guided run builds and applies real masks. Greedy, EOS ignored. Each setting runs `--rounds`
times in turns after a warm-up; the JSON keeps every round and the median ratio. On CUDA, torch's sync debug mode
counts the synchronizing calls of each run (`syncs`): the guided run must not add one per step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import device_name, print_report, sync  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}


def save_bundled_tokenizer(directory: str) -> None:
    """The bundled model's tokenizer (read from its GGUF file) as tokenizer.json + tokenizer_config.json."""
    from dflash2.loading.tokenizer import bundled_model_path, load_tokenizer

    load_tokenizer(bundled_model_path()).save_pretrained(directory)


def model_directory(preset: str, tokenizer_dir: str, into: str) -> str:
    """A checkpoint directory with the preset's architecture, the tokenizer's vocabulary size, no weights."""
    from transformers import AutoTokenizer

    from dflash2.models import registry

    arch = registry.preset(preset)
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim, "vocab_size": vocab, "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope.theta, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(into, "config.json"), "w") as f:
        json.dump(config, f)
    return into


def run(llm, prompts: list[str], params) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        sync()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        sync()
        elapsed = time.perf_counter() - started
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    return {"tok_s": round(tokens / elapsed, 1), "tokens": tokens, "seconds": round(elapsed, 3), "syncs": syncs,
            "first_text": outputs[0].outputs[0].text[:60]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", help="a directory with the tokenizer's files")
    parser.add_argument("--save-bundled-tokenizer", metavar="DIR", help="write the bundled model's tokenizer and exit")
    parser.add_argument("--model", default="llama-3-8b", help="the architecture preset")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.save_bundled_tokenizer:
        save_bundled_tokenizer(args.save_bundled_tokenizer)
        return
    if not args.tokenizer:
        parser.error("--tokenizer DIR is needed (or --save-bundled-tokenizer DIR first)")

    from dflash2 import LLM, SamplingParams
    from dflash2.structured_outputs import StructuredOutputsParams

    with tempfile.TemporaryDirectory() as directory:
        path = model_directory(args.model, args.tokenizer, directory)
        llm = LLM(path, load_format="dummy", tokenizer=args.tokenizer, dtype=args.dtype,
                  max_num_seqs=args.concurrency)
        prompts = [f"Request {i}: describe the weather in a JSON object." for i in range(args.concurrency)]
        plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        guided = dataclasses.replace(plain, structured_outputs=StructuredOutputsParams(json=SCHEMA))
        run(llm, prompts, plain)
        run(llm, prompts, guided)  # warm-up: graphs, the grammar's compilation
        rounds = []
        for _ in range(args.rounds):
            rounds.append({"plain": run(llm, prompts, plain), "json_schema": run(llm, prompts, guided)})
        llm.close()
    ratios = [r["json_schema"]["tok_s"] / r["plain"]["tok_s"] for r in rounds]
    report = {
        "workload": "structured_output", "device": device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": f"{args.model} architecture, dummy weights, vocabulary of {args.tokenizer}",
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "schema": SCHEMA,
        "ratio_median": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
        "rounds": rounds, "command": " ".join(sys.argv),
    }
    print_report(report, args.output)


if __name__ == "__main__":
    main()
