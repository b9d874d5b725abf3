"""SIGTERM drains the server (issue 47, item 1): new requests get 503 with Retry-After and /health 503 "draining",
the streams in flight run on for --shutdown-timeout, the rest end with an error event, and the process exits 0."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.integration.server_process import ServerProcess


def _stream(url: str, max_tokens: int, started: threading.Event, events: list) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                started.set()


@pytest.mark.parametrize("mode", [(), ("--single-process",)], ids=["engine-process", "single-process"])
def test_sigterm_lets_streams_in_flight_finish_refuses_new_ones_and_exits_zero(mode):
    server = ServerProcess("--dtype", "float32", "--max-model-len", "4096", "--shutdown-timeout", "8",
                           "--disable-log-stats", *mode).start()
    try:
        streams = {}
        for name, max_tokens in (("long", 3000), ("short", 12)):
            started, events = threading.Event(), []
            thread = threading.Thread(target=_stream, args=(server.url, max_tokens, started, events))
            thread.start()
            assert started.wait(60)
            streams[name] = (thread, events)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        health = httpx.get(server.url + "/health")
        while health.status_code == 200 and time.monotonic() < deadline:
            health = httpx.get(server.url + "/health")
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert refused.json()["error"]["code"] == "draining"
        assert server.process.wait(30) == 0
        for thread, _ in streams.values():
            thread.join(10)
        short, long = streams["short"][1], streams["long"][1]
        assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
        assert long[-1] == "[DONE]" and "shutting down" in json.loads(long[-2])["error"]["message"]
        assert len(long) > 3  # it ran on while draining
        assert "shutdown timeout: ending the 1 requests still in flight" in server.stderr()
    finally:
        server.cleanup()
