"""`dflash2 serve` as a subprocess on a free localhost port, for benchmarks and tests: start it, wait for
/health, read its logs and /metrics, stop it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None,
                 seen: list[int] | None = None, why: Any = None) -> bool:
    """Poll `url`/health until it answers 200 (True) or `timeout_s` passes (False); raises RuntimeError if
    `process` exits first. Every status seen is appended to `seen`; `why()` adds to the error message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{why() if why else ''}")
        try:
            code = httpx.get(url + "/health", timeout=5).status_code
            if seen is not None:
                seen.append(code)
            if code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


class ServerProcess:
    """`command` (default `python -m dflash2.cli.main serve`) with `--port` and `flags`; stdout and stderr
    go to `log_dir` (a temporary directory by default)."""

    def __init__(self, *flags: str, command: list[str] | None = None, env: dict[str, str] | None = None,
                 log_dir: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*(command or [sys.executable, "-m", "dflash2.cli.main", "serve"]), "--port", str(self.port),
                        *flags]
        self.env = {**os.environ, **(env or {})}
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="dflash2-server-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = self.log_dir / "stdout.log", self.log_dir / "stderr.log"
        self.health_codes: list[int] = []  # every /health status seen while starting
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> "ServerProcess":
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=err, env=self.env)
        if wait_healthy(self.url, timeout_s, self.process, self.health_codes, self.stderr_tail):
            return self
        self.stop()
        raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s:\n{self.stderr_tail()}")

    def stop(self, wait_s: float = 30.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stderr_tail(self, num_lines: int = 40) -> str:
        return "".join(self.stderr().splitlines(keepends=True)[-num_lines:])

    def metric(self, name: str, port: int | None = None, **labels: str) -> float | None:
        """One sample's value from /metrics (None if absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{port}/metrics" if port else self.url + "/metrics"
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None
