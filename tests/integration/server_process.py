"""A real `dflash2-server` process on a free localhost port, for the server tests."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 180.0
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str, command: str) -> list[str]:
    """The installed console script beside this Python, or `python -m dflash2.cli.main <command>`."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "dflash2.cli.main", command]


class ServerProcess:
    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="dflash2-server-")
        self.stdout_path = Path(self._dir.name) / "stdout.log"
        self.stderr_path = Path(self._dir.name) / "stderr.log"
        self.command = [*console_script("dflash2-server", "serve"), "--port", str(self.port), *flags]
        self.health_codes: list[int] = []  # every /health status seen while starting
        self._process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self._process = subprocess.Popen(self.command, stdout=out, stderr=err, env={**os.environ})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the server exited with {self._process.returncode}:\n{self.stderr()}")
            try:
                code = httpx.get(self.url + "/health", timeout=5).status_code
                self.health_codes.append(code)
                if code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{self.stderr()}")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def cleanup(self) -> None:
        self.stop()
        self._dir.cleanup()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def json_logs(self) -> list[dict[str, Any]]:
        """The JSON lines the server wrote to stdout (request and token records)."""
        records = []
        for line in self.stdout_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records

    def metric(self, name: str, port: int | None = None, **labels: str) -> float | None:
        """One sample's value from /metrics (None if absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{port}/metrics" if port else self.url + "/metrics"
        text = httpx.get(url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def wait_for_metric(self, name: str, predicate: Any, timeout_s: float = 30.0, **labels: str) -> float | None:
        deadline = time.monotonic() + timeout_s
        value = self.metric(name, **labels)
        while not predicate(value) and time.monotonic() < deadline:
            time.sleep(0.1)
            value = self.metric(name, **labels)
        return value
