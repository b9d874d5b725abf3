"""The server's engine in a process of its own (the default): what happens when either process goes away.
Each test starts its own server on the bundled model (~10 s)."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.server_process import ServerProcess

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")


def engine_pid(server_pid: int) -> int:
    """The spawned engine process among the server's children (the other one is multiprocessing's tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    engines = [int(pid) for pid in children
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(engines) == 1, children
    return engines[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}/status").exists() else ""
    return "State:\tZ" not in status  # a zombie has exited


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@contextlib.contextmanager
def server_and_engine():
    """A started server on the bundled model and its engine process's pid; stopped at the end."""
    server = ServerProcess("--max-model-len", "1024", "--disable-log-stats").start()
    try:
        yield server, engine_pid(server.process.pid)
    finally:
        server.stop()


def test_an_engine_process_that_dies_fails_the_streams_and_stops_the_server():
    with server_and_engine() as (server, engine):
        body = {"prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 2:
                    os.kill(engine, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        assert "the engine process exited" in events[-2] and "internal_server_error" in events[-2]
        assert server.process.wait(60) == 1
        assert "error: the engine failed: the engine process exited" in server.stderr()


def test_sigint_stops_the_server_and_its_engine_process():
    with server_and_engine() as (server, engine):
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert answer.status_code == 200
        # both processes with the server's collector settings (gc_pauses.settle_collector)
        log = server.stderr()
        assert "engine ready: model SmolLM2-135M-Instruct" in log and "server process:" in log
        assert log.count("thresholds (700, 1, 500)") == 2
        server.process.send_signal(signal.SIGINT)
        # the server drains (nothing in flight), stops its engine process, and exits 0
        assert server.process.wait(60) == 0
        assert "Application shutdown complete." in server.stderr()
        assert gone_within(engine, 10)
        assert "did not stop" not in server.stderr()  # it stopped when asked, not killed


def test_a_server_killed_outright_takes_its_engine_process_along():
    with server_and_engine() as (server, engine):
        server.process.kill()
        server.process.wait(30)
        assert gone_within(engine, 30)  # the end of its commands pipe stopped it
