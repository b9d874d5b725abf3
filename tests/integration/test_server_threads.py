"""The real server's threads (issue 41): its engine process runs torch with the configured thread count (the
physical cores available by default), its HTTP process with one, and no thread of either spins while the server
is idle. No timing assertions: the idle check bounds CPU time used while nothing is asked of the server."""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from dflash2.cpu_threads import physical_cores_available
from tests.integration.server_process import API_KEY

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
IDLE_S = 3.0
IDLE_CPU_LIMIT_S = 0.3  # a thread spinning for the whole window would use IDLE_S


def process_tree(pid: int) -> list[int]:
    """pid and every process below it (the engine process, multiprocessing's tracker)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            todo += [int(child) for child in (task / "children").read_text().split()]
    return tree


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (all their threads), from /proc/<pid>/stat."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the whole line)
    return ticks / os.sysconf("SC_CLK_TCK")


def test_engine_process_runs_the_physical_cores_and_the_http_process_one_thread(real_server):
    assert real_server.metric("dflash2_engine_torch_threads") == physical_cores_available()
    log = real_server.stderr()
    assert "HTTP process: torch threads 1" in log
    assert f"engine: torch threads {physical_cores_available()} (the physical cores available" in log


def test_an_idle_server_does_not_spin(real_server):
    """After a request (so torch's worker threads exist and have run), the server's processes use next to no
    CPU while nothing is asked of them: no thread polls or spins while idle."""
    answer = httpx.post(real_server.url + "/v1/completions", headers=AUTH, timeout=60,
                        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert answer.status_code == 200
    assert real_server.wait_for_metric("dflash2_num_requests_running", lambda v: v == 0) == 0
    assert real_server.wait_for_metric("dflash2_num_requests_waiting", lambda v: v == 0) == 0
    time.sleep(0.5)  # (the scrapes above are work too)
    pids = process_tree(real_server.process.pid)
    assert len(pids) >= 2  # the HTTP process and its engine process
    before = cpu_seconds(pids)
    time.sleep(IDLE_S)
    used = cpu_seconds(pids) - before
    assert used < IDLE_CPU_LIMIT_S, f"{used:.2f} s of CPU in {IDLE_S:.0f} s idle"
