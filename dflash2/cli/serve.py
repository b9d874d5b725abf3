"""`dflash2 serve` (also `dflash2-server`): the OpenAI-compatible HTTP server on one model, or several on one KV
pool (`--model NAME=PATH` repeated, or `--models-config FILE`).

A flag whose choice cannot work (a parallel split the model does not allow, a feature a parallel engine does not
have) is an error at startup that names it, before anything loads; never a silent no-op.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from dflash2.cli.args import add_engine_flags, add_flag, engine_kwargs
from dflash2.engine.served_model import ModelSpec
from dflash2.units import parse_bytes
from dflash2.server.config import (DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_QUEUE_LEN,
                                   DEFAULT_MAX_QUEUE_WAIT_S, DEFAULT_MAX_REQUEST_BYTES, ServerConfig)

def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API)")
    add_server_flags(parser)
    parser.set_defaults(func=run)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser, several_models=True)
    add_flag(parser, "--models-config", default=None,
             help="a JSON or YAML file listing the models to serve on one KV pool, each with its own options: "
                  "name, path, tokenizer, load_format, dtype, quantization (dummy weights), kv_cache_dtype, "
                  "max_num_seqs, min_pool_share, max_pool_share (a list, or {\"models\": [...]})")
    add_flag(parser, "--host", default="127.0.0.1", help="bind address (0.0.0.0 to expose the server)")
    add_flag(parser, "--port", type=int, default=8000)
    add_flag(parser, "--served-model-name", default=None, help="the model's name in the API (default: its file name)")
    add_flag(parser, "--api-key", default=None, help="require Authorization: Bearer KEY (health and metrics stay open)")
    add_flag(parser, "--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
             help="larger request bodies get 413")
    add_flag(parser, "--streaming-timeout-ms", type=int, default=None,
             help="end a stream that produced no token for this long (error event, request aborted)")
    add_flag(parser, "--metrics-port", type=int, default=None, help="also serve /metrics on this port")
    add_flag(parser, "--disable-log-requests", action="store_true", help="no JSON line per finished request")
    add_flag(parser, "--log-tokens", action="store_true", help="a JSON line per generated token")
    add_flag(parser, "--disable-log-stats", action="store_true", help="no periodic throughput line")
    add_flag(parser, "--stream-interval", type=int, default=1,
             help="a stream gets its tokens every this many (its first and last at once): fewer SSE events to "
                  "build and write under load")
    add_flag(parser, "--disable-overlap-schedule", action="store_true",
             help="plan and launch each step only after the previous one is committed (on the GPU the default "
                  "plans step N+1 while N runs): the device idles for each step's host work, but a request "
                  "that arrives during step N runs in N+1 instead of N+2")
    add_flag(parser, "--max-batch-size", type=int, default=None,
             help="the most requests that run in one step (the scheduler's batch); with --max-num-seqs also given, "
                  "that one bounds the requests the server holds (running, paused and waiting: past it, 503)")
    add_flag(parser, "--enforce-eager", action="store_true", help="never capture CUDA graphs")
    add_flag(parser, "--cuda-graph-max-prefill-tokens", type=int, default=2048,
             help="steps with prefill chunks of up to this many tokens also replay CUDA graphs (captured at "
                  "startup for decode rows 0, 1, 2, 4, ... x prefill tokens 16, 32, ...); 0: decode-only graphs")
    add_flag(parser, "--swap-space", type=float, default=0.0,
             help="GiB of pinned host memory for the KV of preempted requests (0: recompute them instead)")
    add_flag(parser, "--preemption-threshold", type=int, default=1,
             help="a waiting request pauses running ones only if it is at least this much more urgent")
    add_flag(parser, "--priority-aging-seconds", type=float, default=None,
             help="a request waiting this long outranks any newer one (no starvation); default: no aging")
    add_flag(parser, "--max-outranked-prefill-tokens", type=int, default=64,
             help="while a more urgent request waits or prefills, the prefill chunks it outranks share at most "
                  "this many tokens a step (keeps its steps short; -1: no cap)")
    add_flag(parser, "--low-priority-values-first", action="store_true",
             help="vLLM's convention: a smaller priority value is more urgent")
    add_flag(parser, "--max-queue-len", type=int, default=DEFAULT_MAX_QUEUE_LEN,
             help="waiting requests beyond this many get 503 with Retry-After; each prompt of a request counts "
                  f"(default: {DEFAULT_MAX_QUEUE_LEN})")
    add_flag(parser, "--max-queue-wait", type=float, default=DEFAULT_MAX_QUEUE_WAIT_S, metavar="SECONDS",
             help="a request expected to wait longer than this (the requests ahead of it at the recent finish "
                  f"rate) gets 503 with Retry-After; 0: no bound (default: {DEFAULT_MAX_QUEUE_WAIT_S:g})")
    add_flag(parser, "--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
             help="a /v1/completions request with more prompts gets 400 "
                  f"(default: {DEFAULT_MAX_PROMPTS_PER_REQUEST})")
    add_flag(parser, "--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
             help=f"the most logprobs / top_logprobs / prompt_logprobs a request may ask for; more gets 400 "
                  f"(default: {DEFAULT_MAX_LOGPROBS}, as vLLM)")
    add_flag(parser, "--max-n", type=int, default=DEFAULT_MAX_N,
             help=f"the most samples (n, best_of) a request may ask for; more gets 400 (default: {DEFAULT_MAX_N})")
    add_flag(parser, "--chat-template", default=None,
             help="a Jinja chat template file used instead of the model's (for every model served)")
    add_flag(parser, "--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
             help="how tool calls are read from the output: hermes (<tool_call>{...}</tool_call>: Qwen, SmolLM), "
                  "llama3_json (Llama 3's JSON), or auto: by the chat template (default)")
    add_flag(parser, "--shutdown-timeout", type=float, default=30.0,
             help="on SIGTERM / SIGINT: seconds the requests in flight may still run (new ones get 503), then the "
                  "rest end with an error and the server exits 0")
    add_flag(parser, "--step-timeout", type=float, default=300.0,
             help="the watchdog: an engine step running longer turns /health to 503 with the reason and ends its "
                  "requests with an error (the server keeps running; a step that comes back serves on); 0: off")
    add_flag(parser, "--single-process", action="store_true",
             help="run the engine on a thread of the HTTP server's process instead of a process of its own "
                  "(one process to debug or profile; the engine's host work and the HTTP side then share a GIL)")
    add_flag(parser, "--disable-nagle", action="store_true",
             help="accepted for compatibility: TCP_NODELAY is always on (uvicorn sets it on every connection)")
    add_flag(parser, "--enable-l3-cache", action="store_true",
             help="the disk (L3) tier of the KV cache: pages leaving host memory are kept in files under "
                  "--l3-cache-path (needs --swap-space), found again by a restarted server")
    add_flag(parser, "--l3-cache-path", default=None, help="an existing, writable directory for the L3 files")
    add_flag(parser, "--l3-cache-size", default=None,
             help="the L3 files' size at most, e.g. 64GiB (default: half the free space there, logged)")
    parser.set_defaults(log_level="info")


def check_parallel(args: argparse.Namespace) -> None:
    """ValueError naming the flag whose parallel choice cannot work, before anything starts or loads."""
    from dflash2.parallel.config import ParallelConfig

    parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size,
                              args.distributed_executor_backend, args.ray_address)
    if not parallel.uses_executor:
        return
    with_split = f"with {parallel.describe()} (--tensor-parallel-size, --pipeline-parallel-size)"
    if args.enable_l3_cache:
        raise ValueError(f"--enable-l3-cache is not supported {with_split}")
    if len(args.model or ()) > 1 or args.models_config is not None:
        raise ValueError(f"several models in one server are not supported {with_split}")
    from dflash2.parallel.executor import check_model_fits

    check_model_fits(ModelSpec.parse(args.model[0]).model if args.model else None, args.load_format, parallel)


def l3_cache_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The disk tier's engine options; ValueError naming the flag for a missing or unusable directory."""
    if not args.enable_l3_cache:
        for given, flag in ((args.l3_cache_path, "--l3-cache-path"), (args.l3_cache_size, "--l3-cache-size")):
            if given is not None:
                raise ValueError(f"{flag} is for the disk (L3) cache: give --enable-l3-cache too")
        return {}
    path = args.l3_cache_path
    if path is None:
        raise ValueError("--enable-l3-cache needs --l3-cache-path DIR (a directory for its files)")
    if not os.path.isdir(path):
        raise ValueError(f"--l3-cache-path {path}: no such directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--l3-cache-path {path}: the directory is not writable")
    if not args.swap_space:
        raise ValueError("--enable-l3-cache reads and writes through host memory: give --swap-space (GiB) too")
    size = None
    if args.l3_cache_size is not None:
        try:
            size = parse_bytes(args.l3_cache_size)
        except ValueError as e:
            raise ValueError(f"--l3-cache-size {args.l3_cache_size}: {e}") from None
        if not size or size <= 0:
            raise ValueError(f"--l3-cache-size must be > 0, got {args.l3_cache_size}")
    return {"l3_cache_path": path, "l3_cache_size": size}


def model_specs(args: argparse.Namespace) -> list[ModelSpec] | None:
    """The models to serve when there are several (or one named NAME=PATH, or a --models-config); None: one
    model, given as --model PATH or not at all (the bundled one), served as before."""
    specs = [ModelSpec.parse(value) for value in args.model or ()]
    if args.models_config is not None:
        specs += read_models_config(args.models_config)
    if not specs or (len(specs) == 1 and specs[0].name is None and args.models_config is None):
        return None
    from dflash2.loading.model_loader import BUNDLED_MODEL_NAME

    names = [spec.served_name() or BUNDLED_MODEL_NAME for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"two models would be served as {duplicates[0]!r}: name them with --model NAME=PATH")
    if args.served_model_name is not None:
        raise ValueError("--served-model-name names a single model; with several, name each with --model NAME=PATH")
    return specs


def read_models_config(path: str) -> list[ModelSpec]:
    """A --models-config file: a JSON or YAML list of model entries, or a mapping with a `models` list."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--models-config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--models-config {path} is not valid JSON or YAML: {e}") from None
    entries = document.get("models") if isinstance(document, dict) else document
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--models-config {path}: expected a non-empty list of models (or {{\"models\": [...]}})")
    specs = []
    for index, entry in enumerate(entries):
        try:
            specs.append(ModelSpec.from_dict(entry))
        except (TypeError, ValueError) as e:
            raise ValueError(f"--models-config {path}, model {index}: {e}") from None
    return specs


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments: the engine flags plus the server's spellings of them."""
    specs = model_specs(args)
    single = (args.model or [None])[0] if specs is None else None
    kwargs = engine_kwargs(argparse.Namespace(**{**vars(args), "model": single}))
    if specs is not None:
        kwargs["models"] = specs
    if args.max_batch_size is not None:
        if args.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
        if args.max_num_seqs is not None and args.max_num_seqs < args.max_batch_size:
            raise ValueError(f"--max-num-seqs {args.max_num_seqs} (requests held) is below --max-batch-size "
                             f"{args.max_batch_size} (requests run in one step)")
        kwargs["max_num_seqs"] = args.max_batch_size
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.disable_overlap_schedule:
        kwargs["overlap"] = False
    if args.cuda_graph_max_prefill_tokens < 0:
        raise ValueError(f"--cuda-graph-max-prefill-tokens must be >= 0, got {args.cuda_graph_max_prefill_tokens}")
    kwargs["cuda_graph_max_prefill_tokens"] = args.cuda_graph_max_prefill_tokens
    if args.swap_space < 0:
        raise ValueError(f"--swap-space must be >= 0 GiB, got {args.swap_space:g}")
    if args.swap_space:
        kwargs["swap_space"] = args.swap_space
    kwargs.update(l3_cache_kwargs(args))
    if args.preemption_threshold < 1:
        raise ValueError(f"--preemption-threshold must be >= 1, got {args.preemption_threshold}")
    if args.priority_aging_seconds is not None and not args.priority_aging_seconds > 0:
        raise ValueError(f"--priority-aging-seconds must be > 0, got {args.priority_aging_seconds:g}")
    if args.max_outranked_prefill_tokens < -1:
        raise ValueError(f"--max-outranked-prefill-tokens must be >= 0 (or -1: no cap), got "
                         f"{args.max_outranked_prefill_tokens}")
    cap = args.max_outranked_prefill_tokens
    kwargs.update(preemption_threshold=args.preemption_threshold,
                  priority_aging_seconds=args.priority_aging_seconds,
                  max_outranked_prefill_tokens=None if cap == -1 else cap,
                  low_priority_values_first=args.low_priority_values_first)
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}")
    kwargs["stream_interval"] = args.stream_interval
    return kwargs


def server_config(args: argparse.Namespace) -> ServerConfig:
    aliases = tuple(args.model) if args.model and len(args.model) == 1 and args.models_config is None else ()
    return ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        model_aliases=aliases, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                        streaming_timeout_ms=args.streaming_timeout_ms, metrics_port=args.metrics_port,
                        disable_log_requests=args.disable_log_requests, disable_log_stats=args.disable_log_stats,
                        log_tokens=args.log_tokens, log_level=args.log_level, max_queue_len=args.max_queue_len,
                        max_queue_wait_s=args.max_queue_wait or None,
                        max_prompts_per_request=args.max_prompts_per_request, max_logprobs=args.max_logprobs,
                        max_n=args.max_n, chat_template=read_chat_template(args.chat_template),
                        tool_call_parser=args.tool_call_parser, single_process=args.single_process, num_threads=args.num_threads,
                        shutdown_timeout_s=args.shutdown_timeout,
                        step_timeout_s=args.step_timeout or None,
                        max_held_requests=args.max_num_seqs if args.max_batch_size is not None else None)


def read_chat_template(path: str | None) -> str | None:
    """The text of a --chat-template file; ValueError naming the flag if it cannot be read or is empty."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--chat-template {path}: {e.strerror}") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path} is empty")
    return text


def build_engine(kwargs: dict[str, Any]) -> Any:
    """The engine as the offline API builds it (so both give the same text); run in the engine process."""
    from dflash2 import LLM

    return LLM(**kwargs).engine


def run(args: argparse.Namespace) -> int:
    check_parallel(args)
    config = server_config(args)
    kwargs = llm_kwargs(args)

    from dflash2.server.launch import serve
    from dflash2.server.restart import restart_command

    return serve(config, functools.partial(build_engine, kwargs), restart_command(sys.argv))


def main() -> None:
    """The `dflash2-server` console script: `dflash2 serve` with the same flags."""
    from dflash2.cli.main import main as dflash2_main

    sys.exit(dflash2_main(["serve", *sys.argv[1:]]))
