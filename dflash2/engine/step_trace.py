"""StepTrace: one JSON line per engine step, for finding what an urgent request waits behind.

Off unless DFLASH2_STEP_TRACE names a file (appended to). Each line, written when the step's results are in:

    t_ms            when the step was planned, from the trace's start (monotonic clock)
    mono_s, done_mono_s
                    when the step was planned and when its results were in, as time.monotonic() (the host-wide
                    clock the server's request log uses: benchmarks/w3_urgent_waits.py joins the two)
    plan_ms, launch_ms, finish_ms
                    host time: Scheduler.plan(), building inputs and launching, collecting and committing
    device_ms       CUDA only: the step's time on the device, from events recorded around its launch (an event
                    is timed when the device reaches it, so a step queued behind another one starts its clock
                    when that one ends); null on the CPU
    decodes, prefill_chunks, prefill_tokens
    graph           the CUDA graph the step replayed, [decode rows, prefill rows] padded; null: it ran eagerly
    decode_context_tokens
                    the decode rows' context lengths, summed (what their attention reads)
    swap_out_pages, swap_in_pages, preempted
    top_priority    the highest priority among the step's requests
    first_token_priority
                    the highest priority among requests whose first token this step samples (null: none)
    sampling_prefills
                    the request ids of the prefill chunks that sample (a prompt's last chunk)
    compiled        the Triton kernels compiled while the step launched, each as Triton names it, with its
                    constants and specializations (a new value class or pointer alignment compiles a variant):
                    what a step that stalls its host for a second waited on; [] when none
    alloc_retries   CUDA only: how often the caching allocator found no free block, freed its cache and
                    retried (a device-wide synchronization each) while the step launched

The records cost a few dict entries and two events a step; the only wait is on the end event, once the step's
own results are in (so it has been reached, or is within microseconds).
"""
from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, TextIO

import torch

from dflash2.engine.plan import StepPlan

if TYPE_CHECKING:
    from dflash2.engine.graphs import GraphShape

ENV = "DFLASH2_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str, device: torch.device) -> None:
        self.file: TextIO = open(path, "a", buffering=1)
        self.cuda = device.type == "cuda"
        self.started = time.monotonic()
        self.compiled: list[str] = []
        self._alloc_retries = self._retries()
        _watch_triton_compiles(self.compiled)

    @classmethod
    def from_env(cls, device: torch.device) -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(path, device) if path else None

    def begin(self, plan: StepPlan, top_priority: int | None, first_token_priority: int | None,
              plan_seconds: float) -> dict[str, Any]:
        """The step's shape, before its launch (which starts the device clock); the priorities as
        step_order.step_priorities found them."""
        decodes = prefill_chunks = prefill_tokens = decode_context_tokens = 0
        sampling_prefills = []
        for chunk in plan.chunks:
            if chunk.is_decode:
                decodes += 1
                decode_context_tokens += chunk.start + 1
            else:
                prefill_chunks += 1
                prefill_tokens += chunk.num_tokens
                if chunk.sample:
                    sampling_prefills.append(chunk.request_id)
        planned = time.monotonic() - plan_seconds
        record: dict[str, Any] = {
            "t_ms": round((planned - self.started) * 1e3, 3), "mono_s": round(planned, 6),
            "plan_ms": round(plan_seconds * 1e3, 3), "launch_ms": None, "finish_ms": None, "device_ms": None,
            "decodes": decodes, "prefill_chunks": prefill_chunks, "prefill_tokens": prefill_tokens,
            "decode_context_tokens": decode_context_tokens,
            "swap_out_pages": len(plan.swap_out), "swap_in_pages": len(plan.swap_in),
            "preempted": len(plan.preempted), "top_priority": top_priority,
            "first_token_priority": first_token_priority, "sampling_prefills": sampling_prefills}
        if self.cuda:
            record["_events"] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            record["_events"][0].record()
        return record

    def launched(self, record: dict[str, Any], launch_seconds: float, graph: GraphShape | None = None) -> None:
        """`graph`: the GraphShape the runner replayed (None: the step ran eagerly)."""
        record["launch_ms"] = round(launch_seconds * 1e3, 3)
        record["graph"] = None if graph is None else [graph.decodes, graph.prefill_tokens]
        record["compiled"] = self.compiled[:]
        self.compiled.clear()
        if self.cuda:
            record["_events"][1].record()
            retries = self._retries()
            record["alloc_retries"] = retries - self._alloc_retries
            self._alloc_retries = retries

    def finished(self, record: dict[str, Any], finish_seconds: float) -> None:
        """Write the line, once the step's results are in."""
        record["finish_ms"] = round(finish_seconds * 1e3, 3)
        record["done_mono_s"] = round(time.monotonic(), 6)
        events = record.pop("_events", None)
        if events is not None:
            events[1].synchronize()  # recorded just after the step's own end event: reached by now, or within us
            record["device_ms"] = round(events[0].elapsed_time(events[1]), 3)
        self.file.write(json.dumps(record) + "\n")

    def _retries(self) -> int:
        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.cuda else 0

    def close(self) -> None:
        if self.compiled in _COMPILE_SINKS:
            _COMPILE_SINKS.remove(self.compiled)
        self.file.close()


_COMPILE_SINKS: list[list[str]] = []  # each open StepTrace's list of kernels compiled since its last step


def _watch_triton_compiles(compiled: list[str]) -> None:
    """Append to `compiled` the repr of every Triton kernel compiled from now on: Triton's jit_cache_hook (run on
    each in-memory cache miss) is set once a process; a hook set before it keeps running after it."""
    _COMPILE_SINKS.append(compiled)
    try:
        from triton import knobs
    except ImportError:  # no Triton (or one without knobs): no record of compiles
        return
    if getattr(knobs.runtime.jit_cache_hook, "dflash2_step_trace", False):
        return
    earlier = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        compiled_as = kwargs.get("compile") or {}
        configs = compiled_as.get("configs") or [None]
        entry = f"{kwargs.get('repr', '?')} constants={compiled_as.get('constants')} attrs={configs[0]}"
        for sink in _COMPILE_SINKS:
            sink.append(entry)
        return earlier(*args, **kwargs) if earlier is not None else None

    hook.dflash2_step_trace = True
    knobs.runtime.jit_cache_hook = hook
