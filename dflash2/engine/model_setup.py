"""A model's weights and the sizes found for it at run time, the pool's size, and the model's runner.

    ModelSpec ─► prepare_model(): weights (load_model, or every rank's part), the scheduler's sizes for the device,
                 max_model_len, KV layout, RunnerOptions ─► PreparedModel
    [PreparedModel, ...] ─► pool_num_pages(): the shared pool's size (--kv-cache-memory, the GPU's profile, or the
                 CPU's default)
    PreparedModel + pool ─► build_runner(): its ModelRunner (or a parallel DriverRunner), EOS ids, CUDA graphs

Config is frozen: what is found here lives in the PreparedModel and the pool, never written back.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from dflash2.config import CacheConfig, DeviceDefaults, ModelArchConfig, SchedulerConfig
from dflash2.engine.config import EngineConfig
from dflash2.engine.graphs import graph_batch_sizes, mixed_graph_shapes
from dflash2.engine.kv.layout import KVLayout, resolve_kv_dtype
from dflash2.engine.memory import gpu_pool_bytes, profile_model_memory
from dflash2.engine.runner import ModelRunner, RunnerOptions
from dflash2.engine.storage import PoolStorage
from dflash2.engine.served_model import ModelSpec, PreparedModel
from dflash2.loading.model_loader import load_model

logger = logging.getLogger("dflash2")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def device_scheduler_config(config: SchedulerConfig, device: torch.device, model_name: str = "") -> SchedulerConfig:
    """The scheduler's sizes the user left unset, chosen for the device; logged, with where each came from."""
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    chosen = config.with_device_defaults(device.type, memory)
    logger.info("batch sizes for %s%s: %s", device.type, f" ({model_name})" if model_name else "", ", ".join(
        f"{name} {getattr(chosen, name)} ({'given' if getattr(config, name) is not None else 'device default'})"
        for name in DeviceDefaults.FIELDS))
    return chosen


def prepare_model(config: EngineConfig, spec: ModelSpec, device: torch.device, executor: Any,
                  single: bool) -> PreparedModel:
    """Load one model's weights and work out its sizes (nothing of the pool yet). `executor`: the other ranks of a
    parallel engine (each loads its part), or None."""
    sched = config.scheduler if spec.max_num_seqs is None else \
        dataclasses.replace(config.scheduler, max_num_seqs=spec.max_num_seqs)
    load_format = spec.load_format or config.load_format
    if spec.quantization is not None and load_format != "dummy":
        raise ValueError("quantization applies to dummy weights only (load_format 'dummy'); convert a "
                         "checkpoint with `dflash2 convert` instead")
    load = load_model if executor is None else executor.load_shard  # (every rank its part)
    model = load(spec.model, load_format, spec.dtype or config.dtype, device, config.scheduler.max_model_len,
                 config.seed, spec.tokenizer or config.tokenizer, quantization=spec.quant_config())
    name = (spec.served_name() if not single or spec.name is not None else None) or model.name
    model.name = name
    scheduler_config = device_scheduler_config(sched, device, name if not single else "")
    max_model_len = max_model_len_for(config.scheduler, model.arch)
    checkpoint_kv = model.quant.kv_cache_dtype if model.quant is not None else None
    kv_dtype = resolve_kv_dtype(spec.kv_cache_dtype or config.cache.kv_cache_dtype, model.dtype, checkpoint_kv)
    layout = KVLayout.for_model(model.arch, kv_dtype, config.cache.page_bytes,
                                head_major=config.cache.kv_layout == "head_major")
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    options = RunnerOptions(attention_backend=backend, seed=config.seed,
                            max_slots=scheduler_config.max_num_seqs, max_model_len=max_model_len,
                            enforce_eager=config.enforce_eager,
                            num_host_pages=config.cache.swap_space_bytes // config.cache.page_bytes)
    return PreparedModel(name, spec, model, scheduler_config, max_model_len, layout, options)


def max_model_len_for(config: SchedulerConfig, arch: ModelArchConfig) -> int:
    limit = config.max_model_len or arch.max_position_embeddings
    if config.max_model_len and limit > arch.max_position_embeddings:
        raise ValueError(f"max_model_len {limit} exceeds the model's max_position_embeddings "
                         f"{arch.max_position_embeddings}")
    if arch.sliding_window and arch.sliding_window < limit:
        logger.warning("sliding-window attention is not implemented; max_model_len capped to the window %d",
                       arch.sliding_window)
        limit = arch.sliding_window
    return limit


def graph_prefill_tokens(config: EngineConfig, scheduler_config: SchedulerConfig, parallel: bool) -> int:
    """The largest prefill a graph is captured for: 0 (decode-only graphs) when graphs are off (a parallel
    engine runs eager for now)."""
    if config.enforce_eager or parallel:
        return 0
    return min(config.cuda_graph_max_prefill_tokens, scheduler_config.max_num_batched_tokens)


def pool_num_pages(config: EngineConfig, device: torch.device, executor: Any, loaded: list[PreparedModel]) -> int:
    """The pool's size: --kv-cache-memory, else on the GPU what the utilization leaves after every model's
    weights and run-time needs, else on the CPU what every model's sequences can use (1 GiB at most each)."""
    cache = config.cache
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        parallel = executor is not None
        if device.type == "cuda" and parallel:  # every rank profiles; the fewest pages
            p = loaded[0]
            return executor.gpu_num_pages(p.model, p.layout, p.options,
                                          p.scheduler_config.max_num_batched_tokens,
                                          p.scheduler_config.max_num_seqs, graph_prefill_tokens(
                                              config, p.scheduler_config, parallel) + p.scheduler_config.max_num_seqs,
                                          cache.gpu_memory_utilization)
        if device.type == "cuda":
            needs = [profile_model_memory(p.model, p.layout, p.options, p.scheduler_config.max_num_batched_tokens,
                                          p.scheduler_config.max_num_seqs,
                                          graph_tokens=graph_prefill_tokens(config, p.scheduler_config, parallel)
                                          + p.scheduler_config.max_num_seqs)
                     for p in loaded]
            budget = gpu_pool_bytes(device, needs, cache.gpu_memory_utilization)
        else:
            budget = 0
            for p in loaded:
                needed_pages = -(-p.max_model_len * p.scheduler_config.max_num_seqs // p.layout.tokens_per_page)
                budget += min(CacheConfig.CPU_DEFAULT_KV_BYTES, needed_pages * p.layout.page_bytes)
    num_pages = budget // cache.page_bytes
    if num_pages < 1:
        raise ValueError(f"the KV cache budget of {budget} bytes holds no page of {cache.page_bytes} bytes")
    return num_pages


def build_runner(config: EngineConfig, prepared: PreparedModel, num_pages: int, storage: PoolStorage,
                 executor: Any) -> tuple[ModelRunner, set[int]]:
    """The model's runner on the pool's `num_pages` pages (rank 0's DriverRunner with an executor), told the
    model's EOS ids (returned too), its CUDA graphs captured on a single-rank CUDA engine."""
    model, scheduler_config = prepared.model, prepared.scheduler_config
    runner = (ModelRunner if executor is None else executor.runner)(
        model, prepared.layout, num_pages, prepared.options, storage=storage)
    eos_token_ids = set(model.arch.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        eos_token_ids.add(model.tokenizer.eos_token_id)
    runner.eos_token_ids = tuple(sorted(eos_token_ids))
    if model.device.type == "cuda" and not config.enforce_eager and executor is None:
        runner.capture_graphs(graph_batch_sizes(scheduler_config.max_num_seqs),
                              mixed_graph_shapes(scheduler_config.max_num_seqs,
                                                 graph_prefill_tokens(config, scheduler_config, executor is not None)))
    return runner, eos_token_ids
