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


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.2)


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
            _stop(successor)
        server.cleanup()


def test_with_an_l3_cache_the_new_server_starts_with_the_old_servers_pages(tmp_path):
    """The old server's prefix cache goes down to the shared L3 directory as it drains; the successor, started
    before that, finds those pages at its first lookup: the same prompt is a disk hit there, same tokens."""
    server = ServerProcess("--dtype", "float32", "--max-model-len", "1024", "--disable-log-stats", "--swap-space",
                           "0.01", "--enable-l3-cache", "--l3-cache-path", str(tmp_path)).start()
    prompt = "A long shared system prompt that the next server should not compute again. " * 6
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    successor = None
    try:
        first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        server.process.send_signal(signal.SIGUSR2)
        assert server.process.wait(120) == 0
        match = re.search(r"the new server \(pid (\d+)\) is ready", server.stderr())
        assert match, server.stderr_tail()
        successor = int(match.group(1))
        assert list(tmp_path.glob("*/*.page")), "the old server wrote its cached pages down as it stopped"
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert again == first
        assert server.metric("dflash2_kv_cache_tier_hit_tokens_total", tier="disk") > 0
    finally:
        if successor is not None:
            _stop(successor)
        server.cleanup()
