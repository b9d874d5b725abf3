"""Signals an operator sends: SIGUSR2 (a restart, not built yet) is logged and ignored, never fatal."""
from __future__ import annotations

import os
import signal
import time

import httpx

from tests.integration.server_process import API_KEY


def test_sigusr2_is_logged_and_the_server_keeps_serving(real_server):
    os.kill(real_server.process.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while "SIGUSR2 received" not in real_server.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "SIGUSR2 received" in real_server.stderr()
    assert real_server.process.poll() is None
    reply = httpx.post(real_server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
