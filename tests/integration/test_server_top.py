"""`dflash2 top --once` renders a real server's /metrics (issue 47, item 7)."""
from __future__ import annotations

import httpx

from dflash2.cli.main import main
from tests.integration.server_process import API_KEY

MODEL = "SmolLM2-135M-Instruct"


def test_top_renders_the_server_once(real_server, capsys):
    reply = httpx.post(real_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "priority": 1000},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert reply.status_code == 200
    assert main(["top", "--url", real_server.url, "--once"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if MODEL in line)
    assert [cell.strip() for cell in row.split("│")[2:5]] == ["0", "0", "0"]  # running, waiting, swapped now
    assert "TTFT by priority class" in out and "1000" in out and "KV pages used / total" in out and "none (CPU)" in out
    assert main(["top", "--url", "http://127.0.0.1:9", "--once"]) == 2  # nothing there: an error, not a trace
    assert "cannot read http://127.0.0.1:9/metrics" in capsys.readouterr().err
