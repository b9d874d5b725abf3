"""Generation.stream_batches: everything queued is sent at once; outputs before an error still go out."""
from __future__ import annotations

import asyncio

from dflash2.request import CompletionOutput, RequestOutput
from dflash2.sampling_params import SamplingParams
from dflash2.server.engine_messages import EngineError
from dflash2.server.generation import Generation, StreamTimeout


class NoEngine:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.first_sent_calls: list[tuple[list[str], float]] = []
        self.counted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def first_sent(self, request_ids: list[str], at: float) -> None:
        self.first_sent_calls.append((request_ids, at))

    def count(self, metric: str) -> None:
        self.counted.append(metric)


def output(token: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "x", [token], None, None, "length" if finished else None)
    return RequestOutput("r", None, [1], None, [completion], finished, delta_text="x", delta_token_ids=[token])


def collect(items: list, timeout_s: float | None = 5.0) -> list:
    async def main():
        generation = Generation(NoEngine(), "r", ["r"])
        for item in items:
            generation.outputs.put_nowait(item)
        batches = []
        try:
            async for batch in generation.stream_batches(timeout_s):
                batches.append([o.delta_token_ids[0] for o in batch])
        except (EngineError, StreamTimeout) as e:
            batches.append(e)
        return batches
    return asyncio.run(main())


def test_outputs_that_piled_up_come_as_one_batch_until_the_last():
    assert collect([output(1), output(2), output(3, finished=True)]) == [[1, 2, 3]]


def test_outputs_before_an_error_are_sent_then_the_error_raised():
    batches = collect([output(1), output(2), EngineError("device lost")])
    assert batches[0] == [1, 2] and isinstance(batches[1], EngineError)


def test_no_output_in_time_is_a_stream_timeout():
    batches = collect([output(1)], timeout_s=0.05)
    assert batches[0] == [1] and isinstance(batches[1], StreamTimeout)


def test_the_first_sent_time_is_the_first_text_the_client_sees():
    """A first token whose text is held back (the bundled instruct model often starts a raw prompt with its
    end-of-turn token, which has no text) is not sent, so the request log's first-written time is stamped with
    the first text that is: after the second output was queued, not at the first."""
    import time
    from types import SimpleNamespace

    from dflash2.server.openai_api import _CompletionFormat, stream_events

    def plain(token: int, text: str, finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(0, text, [token], None, None, "length" if finished else None)
        return RequestOutput("r", None, [1], None, [completion], finished, delta_text=text, delta_token_ids=[token])

    async def main():
        engine = NoEngine()
        state = SimpleNamespace(config=SimpleNamespace(streaming_timeout_ms=None), engine=engine)
        generation = Generation(engine, "r", ["r"])
        handle = SimpleNamespace(name="m", decode=lambda token_ids: "")  # the model (ModelHandle): unused here
        stream = stream_events(state, generation, _CompletionFormat(handle, generation, None, None), False)
        generation.outputs.put_nowait(plain(2, ""))
        queued = {}

        def second() -> None:
            queued["at"] = time.monotonic()
            generation.outputs.put_nowait(plain(7, "x", finished=True))
        asyncio.get_running_loop().call_later(0.05, second)
        first_chunk = await stream.__anext__()
        rest = [chunk async for chunk in stream]
        return first_chunk, rest, generation.timing.first_sent_at, queued["at"], engine

    first_chunk, rest, first_sent_at, second_queued_at, engine = asyncio.run(main())
    assert '"text": "x"' in first_chunk and rest == ["data: [DONE]\n\n"]
    assert first_sent_at is not None and first_sent_at >= second_queued_at
    # the engine hears of it once (the engine process keeps its own copy of the timing for the request log)
    assert engine.first_sent_calls == [(["r"], first_sent_at)]
    assert engine.counted == ["streaming_success"]


class SlowEngine(NoEngine):
    """submit() waits for a step (the engine takes its commands between steps); refuses the ids in `refuse`."""

    def __init__(self, refuse: dict[str, BaseException] | None = None) -> None:
        super().__init__()
        self.in_flight = 0
        self.most_in_flight = 0
        self.refuse = refuse or {}
        self.submitted: list[tuple[str, SamplingParams, str | None]] = []

    async def submit(self, request_id, prompt, params, priority, outputs, timing=None, model=None,
                     shares_prompt_with=None) -> None:
        self.submitted.append((request_id, params, shares_prompt_with))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        if request_id in self.refuse:
            raise self.refuse[request_id]


def test_a_requests_prompts_go_to_the_engine_at_once_not_one_per_step():
    """500 prompts took 17.6 s when each waited for the engine to take the one before (a step each)."""
    engine = SlowEngine()
    prompts = [{"prompt": None, "prompt_token_ids": [1]}] * 50
    generation = asyncio.run(Generation.start(engine, "r", prompts, SamplingParams(), 0,
                                                      response_id="cmpl-client-id"))
    assert engine.most_in_flight == 50 and generation.request_ids[3] == "r-3" and generation.id == "cmpl-client-id"


def test_one_refused_prompt_aborts_the_others_and_a_bad_prompt_outranks_a_full_queue():
    from dflash2.server.engine_messages import QueueFull
    from dflash2.server.protocol import BadRequest

    engine = SlowEngine({"r-1": QueueFull("full", 3), "r-2": ValueError("the prompt has 2000 tokens")})
    prompts = [{"prompt": None, "prompt_token_ids": [1]}] * 3
    try:
        asyncio.run(Generation.start(engine, "r", prompts, SamplingParams(), 0))
    except BadRequest as e:
        assert "2000 tokens" in str(e)
    else:
        raise AssertionError("expected BadRequest")
    assert sorted(engine.aborted) == ["r-0", "r-1", "r-2"]


def test_n_samples_of_each_prompt_follow_its_first_which_prefills_it():
    engine = SlowEngine()
    prompts = [{"prompt": None, "prompt_token_ids": [1]}, {"prompt": None, "prompt_token_ids": [2]}]
    generation = asyncio.run(Generation.start(engine, "r", prompts, SamplingParams(n=2, best_of=3, seed=7), 0))
    assert [(request_id, leader) for request_id, _, leader in engine.submitted] == [
        ("r-0", None), ("r-1", "r-0"), ("r-2", "r-0"), ("r-3", None), ("r-4", "r-3"), ("r-5", "r-3")]
    assert [params.seed for _, params, _ in engine.submitted] == [7, 8, 9, 7, 8, 9]
    assert {(params.n, params.best_of, params.logprobs) for _, params, _ in engine.submitted} == {(1, None, 0)}
    assert (generation.samples_per_prompt, generation.n) == (3, 2)
    finals = [RequestOutput(f"r-{i}", None, [1], None, [CompletionOutput(0, "", [5], logprob, [])], True)
              for i, logprob in enumerate([-3.0, -1.0, -2.0, -0.5, -0.5, -9.0])]
    assert [o.request_id for o in generation.choices(finals)] == ["r-1", "r-2", "r-3", "r-4"]
