"""argparse helpers: every long flag answers to both spellings, `--max-tokens` and `--max_tokens`."""
from __future__ import annotations

import argparse
from typing import Any


def add_flag(parser: argparse.ArgumentParser | Any, *names: str, **kwargs: Any) -> None:
    """Register a flag under its dashed and underscored spellings (and any extra aliases given)."""
    spellings: list[str] = []
    for name in names:
        for variant in (name, "--" + name[2:].replace("-", "_"), "--" + name[2:].replace("_", "-")):
            if variant not in spellings:
                spellings.append(variant)
    parser.add_argument(*spellings, **kwargs)


def add_engine_flags(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Flags that choose the model and size the engine (shared by the commands that load a model).
    `several_models`: --model may repeat (NAME=PATH), each one served on the same pool."""
    model_help = "HF directory, .gguf file, or preset name with --load-format dummy (default: bundled SmolLM2-135M)"
    if several_models:
        add_flag(parser, "--model", "--model-path", "--model-dir", dest="model", action="append", default=None,
                 help=f"{model_help}; repeat it to serve several models on one KV pool, NAME=PATH to name one "
                      f"(default name: the file or directory stem)")
    else:
        add_flag(parser, "--model", "--model-path", "--model-dir", dest="model", default=None, help=model_help)
    add_flag(parser, "--tokenizer", default=None, help="tokenizer directory or .gguf (default: the model's)")
    add_flag(parser, "--load-format", default="auto", choices=["auto", "hf", "gguf", "dummy"])
    add_flag(parser, "--dtype", default="auto",
             help="auto (a GGUF file's Q4_0/Q4_1/Q8_0 tensors in their own precision, the rest float32 on CPU, "
                  "bfloat16 on GPU), float32, bfloat16, float16 (every weight dequantized to it)")
    add_flag(parser, "--device", default="auto", help="auto, cpu or cuda")
    add_flag(parser, "--seed", type=int, default=0)
    add_flag(parser, "--max-model-len", type=int, default=None)
    by_device = ("default: by device (CPU 64 / 2048 / 512; a GPU of 70+ GiB 1024 / 8192 / 512; smaller GPUs "
                 "256 / 4096 / 512)")
    add_flag(parser, "--max-num-seqs", type=int, default=None, help=f"requests run together; {by_device}")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=None, help="tokens in one step; see --max-num-seqs")
    add_flag(parser, "--prefill-chunk-size", type=int, default=None,
             help="the most prompt tokens of one request in a step; see --max-num-seqs")
    add_flag(parser, "--kv-cache-dtype", default="auto",
             help="auto (a converted checkpoint's choice, else the model dtype), bf16, fp16, fp32, fp8, int8, int4; "
                  "fp8/int8/int4 keep an fp16 scale per token and head in the page")
    add_flag(parser, "--kv-cache-memory", default=None, help="KV page pool size, e.g. 512MiB (overrides sizing)")
    add_flag(parser, "--gpu-memory-utilization", type=float, default=0.9)
    add_flag(parser, "--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    add_flag(parser, "--num-threads", type=int, default=None,
             help="torch threads of the process that runs the engine (default: the physical cores available to "
                  "it, from its CPU affinity and cgroup quota; 1 on a machine shared with other busy programs)")
    add_flag(parser, "--log-level", default="warning")
    add_flag(parser, "--tensor-parallel-size", "--tp", type=int, default=1,
             help="ranks each layer is split over (attention heads, MLP and experts' features, vocabulary); "
                  "docs/PARALLEL.md")
    add_flag(parser, "--pipeline-parallel-size", "--pp", type=int, default=1,
             help="stages the layers are split into, one after the other (ranks: tensor x pipeline)")
    add_flag(parser, "--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
             help="what runs the other ranks: mp (processes of this host; the default for several ranks), ray "
                  "(Ray actors, across machines), uni (one process)")
    add_flag(parser, "--ray-address", default=None,
             help="the Ray cluster: auto (the one running here), HOST:PORT; implies --distributed-executor-backend "
                  "ray (default: RAY_ADDRESS, else a new local instance)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM(...) keyword arguments named by the engine flags."""
    return dict(model=args.model, tokenizer=args.tokenizer, load_format=args.load_format, dtype=args.dtype,
                device=args.device, seed=args.seed, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                prefill_chunk_size=args.prefill_chunk_size, kv_cache_dtype=args.kv_cache_dtype,
                kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=args.enable_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend, ray_address=args.ray_address)
