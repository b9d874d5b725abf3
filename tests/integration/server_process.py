"""A real `dflash2-server` process on a free localhost port, for the server tests."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dflash2.bench.server_process import ServerProcess as BaseServerProcess
from dflash2.bench.server_process import free_port  # noqa: F401  (the tests take ports from here)

STARTUP_TIMEOUT_S = 180.0
API_KEY = "test-key"


def console_script(name: str, command: str) -> list[str]:
    """The installed console script beside this Python, or `python -m dflash2.cli.main <command>`."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "dflash2.cli.main", command]


class ServerProcess(BaseServerProcess):
    """The installed `dflash2-server` with these flags, logs in a temporary directory removed by cleanup()."""

    def __init__(self, *flags: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dflash2-server-")
        super().__init__(*flags, command=console_script("dflash2-server", "serve"), log_dir=self._dir.name)

    def start(self) -> ServerProcess:  # type: ignore[override]
        super().start(STARTUP_TIMEOUT_S)
        return self

    def cleanup(self) -> None:
        self.stop(20)
        self._dir.cleanup()

    def json_logs(self) -> list[dict[str, Any]]:
        """The JSON lines the server wrote to stdout (request and token records)."""
        records = []
        for line in self.stdout_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records

    def wait_for_metric(self, name: str, predicate: Any, timeout_s: float = 30.0, **labels: str) -> float | None:
        deadline = time.monotonic() + timeout_s
        value = self.metric(name, **labels)
        while not predicate(value) and time.monotonic() < deadline:
            time.sleep(0.1)
            value = self.metric(name, **labels)
        return value
