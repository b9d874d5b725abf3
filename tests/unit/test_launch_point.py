"""The launch point (EngineConfig.plan_next_step_at): where in a step it comes, and its bounds. On the CPU steps are
not overlapped and have none; the GPU tests run it (tests/gpu/test_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.engine.runner import launch_point_layer
from dflash2.models.llama import ForwardContext


def test_launch_point_layer_is_the_fraction_of_the_layers_inside_the_step():
    assert launch_point_layer(28, 0.0) == 0  # none
    assert launch_point_layer(28, 0.5) == 14
    assert launch_point_layer(28, 0.25) == 7
    assert launch_point_layer(28, 0.99) == 27  # at most all but the last layer
    assert launch_point_layer(28, 0.01) == 1  # at least one layer
    assert launch_point_layer(1, 0.5) == 0  # a one-layer model has no point inside its step
    for bad in (1.0, -0.1, 2.0):
        with pytest.raises(ValueError, match="fraction"):
            launch_point_layer(28, bad)


class _Recorder:
    """Stands in for a CUDA event: the model only calls record(); which layer had run by then is read from the
    forward hooks below."""

    def __init__(self, log: list) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("event")


@pytest.mark.parametrize("after", [1, 2])
def test_the_model_records_the_event_after_that_many_layers(tiny_llama, after):
    """ForwardContext.layer_event = (k, event): event.record() right after layer k - 1 returns, once a forward."""
    engine = LLM(tiny_llama, max_model_len=64, kv_cache_memory="1MiB", page_bytes=4096).engine
    module = engine.model.module
    log: list = []
    for index, layer in enumerate(module.layers):
        layer.register_forward_hook(lambda *args, index=index: log.append(index))
    runner = engine.runner
    request = engine.add_request({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=1))
    plan = engine.scheduler.plan()
    from dflash2.engine.runner import _HostBatch

    host = _HostBatch.build(list(plan.chunks), 0)
    meta = runner._metadata(host, 0)
    context = ForwardContext(positions=meta.positions, attention=meta, kv_caches=runner.kv_caches,
                             attention_backend=runner.attention, layer_event=(after, _Recorder(log)))
    module(torch.tensor(host.token_ids), context)
    assert len(module.layers) == 2 and request.num_prompt_tokens == 3
    assert log == ([0, "event", 1] if after == 1 else [0, 1, "event"])


def test_plan_next_step_at_is_checked_and_cpu_steps_have_no_launch_point(tiny_llama):
    for bad in (1.0, -0.5):
        with pytest.raises(ValueError, match="plan_next_step_at"):
            LLM(tiny_llama, plan_next_step_at=bad)
    engine = LLM(tiny_llama, max_model_len=64, kv_cache_memory="1MiB", page_bytes=4096,
                 plan_next_step_at=0.5).engine
    assert engine.runner.launch_point_layer == 0  # CPU: no overlap, no events
    engine.add_request({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.wait_launch_point()  # returns at once
        engine.step()
    assert engine.pool.num_used == 0
