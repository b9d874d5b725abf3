"""Zero-downtime restart (issue 47, item 2): SIGUSR2 starts a successor on the same listening socket; the old server
drains once the new one serves; a client sending steadily through it all gets every answer whole, none failed."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.integration.server_process import ServerProcess

pytestmark = pytest.mark.slow


def test_sigusr2_hands_the_socket_to_a_new_server_without_a_failed_request():
    server = ServerProcess("--dtype", "float32", "--max-model-len", "1024", "--disable-log-stats").start()
    successor = None
    try:
        results: list[str] = []
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                while not stop.is_set():
                    try:
                        reply = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "ignore_eos": True})
                        ok = reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
                        results.append("ok" if ok else f"{reply.status_code} {reply.text[:200]}")
                    except httpx.HTTPError as e:
                        results.append(f"{type(e).__name__}: {e}")
        sender = threading.Thread(target=client)
        sender.start()
        time.sleep(1.0)
        server.process.send_signal(signal.SIGUSR2)
        assert server.process.wait(120) == 0  # the old server handed over and drained
        match = re.search(r"the new server \(pid (\d+)\) is ready", server.stderr())
        assert match, server.stderr_tail()
        successor = int(match.group(1))
        before = len(results)
        deadline = time.monotonic() + 90
        while len(results) < before + 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # the new server answers on the same port
        stop.set()
        sender.join(60)
        assert len(results) >= before + 3
        assert [r for r in results if r != "ok"] == []
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    finally:
        if successor is not None:
            os.kill(successor, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and os.path.exists(f"/proc/{successor}"):
                time.sleep(0.2)
        server.cleanup()
