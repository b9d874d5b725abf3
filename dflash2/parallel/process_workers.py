"""ProcessWorkers (the "mp" executor): one process of this host per rank but 0, `python -m dflash2.parallel.worker`.

Rank r runs on cuda:(i + r) where rank 0 runs on cuda:i (the engine's device), or on the CPU. A worker is a
session of its own (a Ctrl-C at the terminal reaches rank 0, which stops it), imports the same dflash2 as rank 0
(its package directory goes first on PYTHONPATH), inherits the environment (NCCL_*, GLOO_*: docs/PARALLEL.md)
and writes its log to the same stderr.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from typing import Any

import torch

from dflash2.parallel.config import ParallelConfig


class ProcessWorkers:
    store_host = "127.0.0.1"

    def __init__(self, parallel: ParallelConfig, device: str) -> None:
        from dflash2.engine.model_setup import resolve_device

        self.world_size = parallel.world_size
        first = resolve_device(device)
        if first.type == "cuda":
            index = first.index or 0
            count = torch.cuda.device_count()
            if index + self.world_size > count:
                raise ValueError(f"{parallel.describe()} need {self.world_size} CUDA devices from cuda:{index} on, "
                                 f"but this host has {count - index} there ({count} visible)")
            self.devices = [torch.device("cuda", index + rank) for rank in range(self.world_size)]
        else:
            self.devices = [first] * self.world_size
        self.processes: dict[int, subprocess.Popen] = {}

    def start(self, init_method: str, configs: dict[int, Any]) -> None:
        env = worker_environment()
        for rank, config in configs.items():
            process = subprocess.Popen([sys.executable, "-m", "dflash2.parallel.worker", str(rank),
                                        str(self.world_size), init_method], stdin=subprocess.PIPE, env=env,
                                       start_new_session=True)
            self.processes[rank] = process
            process.stdin.write(pickle.dumps(config))
            process.stdin.close()

    def problem(self, rank: int) -> str | None:
        """Why this worker is not running (None: it runs)."""
        return exit_reason(self.processes[rank].poll())

    def describe(self, rank: int) -> str:
        return f"pid {self.processes[rank].pid}"

    def pid(self, rank: int) -> int:
        return self.processes[rank].pid

    def kill(self, rank: int) -> None:
        process = self.processes.get(rank)
        if process is not None and process.poll() is None:
            process.kill()

    def join(self, timeout_s: float) -> None:
        """Wait for the workers to end (they were told to stop), killing those still running after timeout_s."""
        for rank, process in self.processes.items():
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def exit_reason(code: int | None) -> str | None:
    if code is None:
        return None
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def worker_environment() -> dict[str, str]:
    """This process's environment, with this dflash2 first on PYTHONPATH and NVLink multicast off by default."""
    import dflash2

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(dflash2.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env
