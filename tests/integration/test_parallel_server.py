"""A real server on two ranks (issue 46, item 4): it answers as one process does; a worker killed mid-stream turns
/health to 503 naming the rank within seconds, the stream in flight ends with an error saying so, and later requests
get that error too (the server neither hangs nor pretends to be well)."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from dflash2 import LLM, SamplingParams
from tests.integration.server_process import ServerProcess
from tests.tiny_models import build_tiny_model
from tests.unit.test_convert_tiny import save_byte_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("parallel-server") / "llama")
    build_tiny_model("llama", directory)
    save_byte_tokenizer(directory)
    return directory


def worker_pid(server: ServerProcess) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"rank 1 of 2 joined on cpu \(pid (\d+)\)", server.stderr())
        if found:
            return int(found.group(1))
        time.sleep(0.2)
    raise AssertionError(f"no worker pid in the log:\n{server.stderr_tail()}")


def test_a_killed_worker_turns_health_red_and_ends_the_request_in_flight(model):
    with LLM(model, max_model_len=512) as llm:
        alone = llm.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    server = ServerProcess("--model", model, "--tensor-parallel-size", "2", "--max-model-len", "512",
                           "--disable-log-stats").start()
    try:
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == alone.outputs[0].text
        assert httpx.get(server.url + "/health").status_code == 200
        pid = worker_pid(server)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 3:
                        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        assert events[-1] == "[DONE]"
        message = json.loads(events[-2])["error"]["message"]
        assert "worker rank 1" in message and "SIGKILL" in message
        assert len(events) < 400  # ended, not finished
        health = httpx.get(server.url + "/health")
        while health.status_code == 200 and time.monotonic() < killed + 5:
            time.sleep(0.1)
            health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "worker rank 1" in health.json()["reason"]
        later = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert later.status_code == 500 and "worker rank 1" in later.json()["error"]["message"]
    finally:
        server.cleanup()
