"""The engine process's wire, without a process: results frames split anywhere by the pipe come out whole and
in order, and output deltas rebuild the RequestOutputs the handlers read."""
from __future__ import annotations

import asyncio
import pickle

import pytest

from dflash2.engine.sampler import Logprob
from dflash2.request import CompletionOutput, RequestOutput
from dflash2.server.engine_process import EngineProcess, EngineProcessSpec, _Frames, _Stream
from dflash2.server.process_loop import FRAME_HEADER, _wire_output
from dflash2.server.observer import ObserverConfig


def frame(message: tuple) -> bytes:
    payload = pickle.dumps(message)
    return FRAME_HEADER.pack(len(payload)) + payload


def test_frames_cut_at_every_byte_come_out_whole_and_in_order():
    messages = [("out", [("delta", "r1", "é", [1, 2], None)]), ("accepted", "r2", None), ("ready", "x" * 5000)]
    data = b"".join(frame(m) for m in messages)
    for chunk in (1, 3, 7, 4096, len(data)):
        seen, ended = [], []
        frames = _Frames(seen.append, lambda: ended.append(True))
        for start in range(0, len(data), chunk):
            frames.data_received(data[start:start + chunk])
        assert seen == messages and not frames.buffer
        frames.connection_lost(None)
        assert ended == [True]


def test_deltas_rebuild_outputs_and_the_last_one_comes_whole():
    process = EngineProcess(EngineProcessSpec(lambda: None, ObserverConfig(), None, None, "info", False))
    queue: asyncio.Queue = asyncio.Queue()
    process._streams["r"] = _Stream(queue)
    entries = [{5: Logprob(-0.5, 1)}, {6: Logprob(-1.0, 1)}, {7: Logprob(-0.25, 1)}]
    engine_side = []
    for count in (1, 2):  # the engine's outputs: its live lists, the delta since the previous output
        completion = CompletionOutput(0, "ab"[:count], [5, 6][:count], None, entries[:count])
        engine_side.append(RequestOutput("r", None, [1, 2], None, [completion], False,
                                         delta_text="ab"[count - 1], delta_token_ids=[[5, 6][count - 1]]))
    last = RequestOutput("r", "p", [1, 2], None, [CompletionOutput(0, "abc", [5, 6, 7], -1.75, entries, "length")],
                         True, delta_text="c", delta_token_ids=[7])
    for output in (*engine_side, last):
        process._dispatch(pickle.loads(pickle.dumps(("out", [_wire_output(output)]))))
    first, second, final = (queue.get_nowait() for _ in range(3))
    assert (first.delta_text, first.delta_token_ids, first.finished) == ("a", [5], False)
    assert first.outputs[0].logprobs == entries[:1]  # its own entries, not what came later
    assert (second.delta_text, second.delta_token_ids, second.outputs[0].logprobs) == ("b", [6], entries[:2])
    assert final.finished and final.outputs[0].text == "abc" and final.outputs[0].token_ids == [5, 6, 7]
    assert final.prompt_token_ids == [1, 2] and final.outputs[0].finish_reason == "length"
    assert "r" not in process._streams  # the stream ends with its last output
    process._dispatch(("out", [("delta", "r", "late", [9], None)]))  # (aborted or finished: dropped)
    assert queue.empty()


def test_refusals_keep_their_kind():
    async def main():
        process = EngineProcess(EngineProcessSpec(lambda: None, ObserverConfig(), None, 4, "info", False))
        process._loop = asyncio.get_running_loop()
        sent = []
        process._send = sent.append
        outcomes = []
        for request_id, answer in (("a", ("value", "too long")), ("b", ("queue_full", "4 waiting", 7)), ("c", None)):
            task = asyncio.ensure_future(process.submit(request_id, {"prompt_token_ids": [1]}, None, 0,
                                                        asyncio.Queue()))
            await asyncio.sleep(0)
            process._dispatch(("accepted", request_id, answer))
            try:
                await task
                outcomes.append("taken")
            except Exception as e:  # noqa: BLE001
                outcomes.append((type(e).__name__, str(e)))
        return outcomes, [m[:2] for m in sent], process.retry_after_s, set(process._streams)

    outcomes, sent, retry_after_s, streams = asyncio.run(main())
    assert outcomes == [("ValueError", "too long"), ("QueueFull", "4 waiting"), "taken"]
    assert sent == [("submit", "a"), ("submit", "b"), ("submit", "c")] and retry_after_s == 7
    assert streams == {"c"}  # only the request taken keeps a stream


def test_commands_cross_as_frames_the_engine_reads_whole():
    """The engine process's side of the commands pipe: a submission written in pieces is read whole, and the
    pipe's end reads as Stop."""
    import os
    import threading
    from multiprocessing import Pipe

    from dflash2.server.engine_messages import Stop, Submit
    from dflash2.server.process_loop import _ProcessLoop, encode_frame

    commands_in, commands_out = Pipe(duplex=False)
    loop = _ProcessLoop(EngineProcessSpec(lambda: None, ObserverConfig(), None, None, "info", False), commands_in,
                        None)
    frame = encode_frame(("submit", "r", {"prompt_token_ids": list(range(40_000))}, None, 5, 1.0, 2.0, None, None))
    assert len(frame) > 65_536  # more than a pipe's buffer

    def write_in_pieces() -> None:
        fd = commands_out.fileno()
        for start in range(0, len(frame), 10_000):
            os.write(fd, frame[start:start + 10_000])
        commands_out.close()
    writer = threading.Thread(target=write_in_pieces)
    writer.start()
    command = loop.receive(block=True)
    writer.join()
    assert isinstance(command, Submit) and command.request_id == "r" and command.priority == 5
    assert command.prompt["prompt_token_ids"] == list(range(40_000))
    assert (command.timing.received_at, command.submitted_at) == (1.0, 2.0)
    assert isinstance(loop.receive(block=True), Stop)  # the server closed its end


def test_a_tokenizer_that_does_not_pickle_is_a_load_error_that_says_so():
    import os
    from multiprocessing import Pipe
    from types import SimpleNamespace

    import pytest

    from dflash2.server.process_loop import _ProcessLoop

    results_in, results_out = Pipe(duplex=False)
    loop = _ProcessLoop(EngineProcessSpec(lambda: None, ObserverConfig(), None, None, "info", False), None,
                        results_out)
    loop.engine = SimpleNamespace(model=SimpleNamespace(name="m", arch=SimpleNamespace(vocab_size=10)),
                                  max_model_len=8, tokenizer=lambda text: [1])  # a lambda does not pickle
    with pytest.raises(Exception):
        loop.on_loaded()
    results_out.close()
    seen = []
    frames = _Frames(seen.append, lambda: None)
    while chunk := os.read(results_in.fileno(), 65536):
        frames.data_received(chunk)
    assert len(seen) == 1 and seen[0][0] == "load_error"
    assert "cannot be sent to the server process" in seen[0][1] and "--single-process" in seen[0][1]


def test_metrics_render_under_a_short_switch_interval_and_restore_it():
    import sys

    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client.exposition import generate_latest

    from dflash2.server.process_loop import RENDER_SWITCH_INTERVAL_S, _QuickSwitchRegistry

    registry = CollectorRegistry()
    Counter("dflash2_test_total", "a counter", registry=registry).inc(3)
    before = sys.getswitchinterval()
    seen = []

    class Spy:  # reports the interval while its families are collected; one render inside another
        def __init__(self, inner=None):
            self.inner = inner

        def collect(self):
            seen.append(sys.getswitchinterval())
            if self.inner is not None:
                generate_latest(_QuickSwitchRegistry(self.inner))
                seen.append(sys.getswitchinterval())  # the inner render ended; this one still runs
            yield from registry.collect()

    assert generate_latest(_QuickSwitchRegistry(registry)) == generate_latest(registry)
    names = {"dflash2_test_total"}  # a scrape by name[] (the metrics port's server restricts the registry)
    assert (generate_latest(_QuickSwitchRegistry(registry).restricted_registry(names))
            == generate_latest(registry.restricted_registry(names)))
    generate_latest(_QuickSwitchRegistry(Spy(Spy())))
    assert seen == [pytest.approx(RENDER_SWITCH_INTERVAL_S)] * 3
    assert sys.getswitchinterval() == before


def test_gated_metrics_render_takes_each_family_only_while_the_loop_waits(monkeypatch):
    import threading
    import time

    from prometheus_client import CollectorRegistry, Counter, Gauge
    from prometheus_client.exposition import generate_latest

    from dflash2.server import process_loop
    from dflash2.server.process_loop import _QuickSwitchRegistry

    registry = CollectorRegistry()
    Counter("dflash2_test_total", "a counter", registry=registry).inc(3)
    Gauge("dflash2_test_gauge", "a gauge", registry=registry).set(7)
    loop_waits = threading.Event()
    states = []

    class Watched:  # each family of the registry, with the loop's state when it was taken
        def collect(self):
            for family in registry.collect():
                states.append(loop_waits.is_set())
                yield family

    monkeypatch.setattr(process_loop, "RENDER_WAIT_LIMIT_S", 60.0)
    texts = []
    render = threading.Thread(target=lambda: texts.append(generate_latest(_QuickSwitchRegistry(Watched(), loop_waits))))
    render.start()
    time.sleep(0.05)  # the loop is busy: an ungated render would have taken its families by now
    loop_waits.set()
    render.join(10)
    assert texts == [generate_latest(registry)] and states == [True, True]

    # past the limit, a render finishes without the loop waiting (a loop that never waits still gets scraped)
    monkeypatch.setattr(process_loop, "RENDER_WAIT_LIMIT_S", 0.0)
    loop_waits.clear()
    states.clear()
    assert generate_latest(_QuickSwitchRegistry(Watched(), loop_waits)) == generate_latest(registry)
    assert states == [False, False]
    # restricted to some names (the metrics port's server), it keeps the gate
    assert _QuickSwitchRegistry(registry, loop_waits).restricted_registry({"x"}).loop_waits is loop_waits
