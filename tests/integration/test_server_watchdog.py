"""The engine's watchdog (issue 47, item 3): a step stalled past --step-timeout (injected) turns /health to 503 with
the reason and ends its stream with an error event; the server is not killed, and once the step comes back it
answers 200 and serves the next request."""
from __future__ import annotations

import json
import time

import httpx

from dflash2.bench.server_process import ServerProcess
from tests.integration.server_process import STARTUP_TIMEOUT_S, console_script


def test_a_stalled_step_turns_health_red_ends_its_requests_and_the_server_recovers():
    server = ServerProcess("--dtype", "float32", "--step-timeout", "3", "--disable-log-stats",
                           command=console_script("dflash2-server", "serve"),
                           env={"DFLASH2_INJECT_STEP_STALL": "12:3"}).start(STARTUP_TIMEOUT_S)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 40, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        assert events[-1] == "[DONE]" and "the engine is stuck" in json.loads(events[-2])["error"]["message"]
        deadline = time.monotonic() + 5
        health = httpx.get(server.url + "/health")
        while health.status_code == 200 and time.monotonic() < deadline:  # the stream ended within the stall
            health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "has not finished in 3 s (--step-timeout)" in health.json()["reason"]
        deadline = time.monotonic() + 30
        while health.status_code != 200 and time.monotonic() < deadline:  # the step comes back after 12 s
            time.sleep(0.2)
            health = httpx.get(server.url + "/health")
        assert health.json() == {"status": "ok"}
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert server.metric("dflash2_kv_cache_used_pages") == 0
        assert "the stuck step finished after" in server.stderr()
    finally:
        server.stop()
