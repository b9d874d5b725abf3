"""Size the GPU page pool: what `gpu_memory_utilization` allows, minus what the models need to run; and give
device memory back when models or the engine go.

    total * utilization  =  peak of a profiling step (every model's weights + the activations of the largest
                            batch of the model whose step needs most: one model steps at a time)
                         +  each model's reserve (CUDA graphs: the activations of its largest captured step,
                            every decode graph's logits and the mixed graphs' shared logits buffer; 1 GiB of
                            allocator slack)
                         +  page pool   <- the rest
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dflash2.engine.plan import ScheduledChunk, StepPlan
from dflash2.request import Request
from dflash2.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dflash2.engine.kv.layout import KVLayout
    from dflash2.engine.runner import RunnerOptions
    from dflash2.loading.model_loader import LoadedModel

logger = logging.getLogger("dflash2")

GRAPH_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelMemory:
    """One model's memory needs beside the pool, from a profiling step."""

    peak: int  # bytes allocated at the peak of its largest step (every loaded model's weights included)
    reserve: int  # bytes its CUDA graphs and the allocator's slack keep besides


def profile_model_memory(model: "LoadedModel", layout: "KVLayout", options: "RunnerOptions",
                         max_num_batched_tokens: int, max_num_seqs: int, graph_tokens: int = 0,
                         runner_factory: Callable[..., Any] | None = None) -> ModelMemory:
    """A profiling step of `max_num_batched_tokens` tokens; the CUDA graphs' own memory pool is taken to need the
    activations of a `graph_tokens`-token step (scaled from the profile). `runner_factory` builds the profiling
    runner as ModelRunner(model, layout, num_pages, options) would (the parallel ranks' runners step together)."""
    from dflash2.engine.runner import ModelRunner, RunnerOptions

    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    # the largest prefill step: max_num_batched_tokens tokens in chunks no longer than a sequence may be
    per_chunk = max(1, min(max_num_batched_tokens, options.max_model_len - 1))
    sizes = [per_chunk] * (max_num_batched_tokens // per_chunk)
    if max_num_batched_tokens % per_chunk:
        sizes.append(max_num_batched_tokens % per_chunk)
    pages_each = -(-per_chunk // layout.tokens_per_page)
    profile_options = RunnerOptions(options.attention_backend, options.seed, max_slots=len(sizes),
                                    max_model_len=per_chunk)
    runner = (runner_factory or ModelRunner)(model, layout, pages_each * len(sizes), profile_options)
    chunks, requests = [], {}
    for slot, size in enumerate(sizes):
        request_id = f"profile-{slot}"
        pages = tuple(range(slot * pages_each, (slot + 1) * pages_each))
        chunks.append(ScheduledChunk(request_id, 0, tuple([0] * size), slot=slot, new_pages_start=0,
                                     new_page_ids=pages, sample=True))
        requests[request_id] = Request(request_id, [0] * size, SamplingParams(max_tokens=1))
    runner.execute(StepPlan(chunks), requests)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del runner
    torch.cuda.empty_cache()
    # the graphs' logits (float32 at most): one buffer for all graphs, and the largest graph's own before it
    # copies them there (a graph's rows: its decode rows and a sampling row per prefill chunk, at most 2 x seqs)
    logits_bytes = 2 * (2 * max_num_seqs) * model.arch.vocab_size * 4
    graph_activations = int((peak - before) * min(1.0, graph_tokens / max_num_batched_tokens))
    return ModelMemory(peak, GRAPH_RESERVE_BYTES + graph_activations + logits_bytes)


def gpu_pool_bytes(device: torch.device, needs: list[ModelMemory], utilization: float) -> int:
    """Bytes left for the page pool: total * utilization less the highest peak and every model's reserve."""
    total = torch.cuda.get_device_properties(device).total_memory
    peak = max(need.peak for need in needs)
    reserve = sum(need.reserve for need in needs)
    budget = int(total * utilization) - peak - reserve
    logger.info("GPU memory: %.2f GiB total, utilization %.2f, profiling peak %.2f GiB, graphs and slack %.2f GiB "
                "(%d model%s), pool %.2f GiB", total / 2**30, utilization, peak / 2**30, reserve / 2**30,
                len(needs), "s" if len(needs) != 1 else "", budget / 2**30)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no memory for the KV cache: the model"
                         f"{'s need' if len(needs) > 1 else ' needs'} {(peak + reserve) / 2**30:.2f} GiB of "
                         f"{total / 2**30:.2f} GiB; raise it or lower max_num_batched_tokens")
    return budget


def release_device_memory() -> None:
    """Collect what still points at device tensors through a cycle and give the allocator's cache back."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def release_cublas_workspaces() -> None:
    """cuBLAS's per-stream workspaces, once the engine's streams are gone."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
