"""An abort storm (issue 47, item 5): two hundred streams closed by the client mid-flight, 64 open at once,
leave the server's KV pages and request counts exactly where they were, and it serves on."""
from __future__ import annotations

import httpx
import pytest

from benchmarks.abort_storm import run
from tests.integration.server_process import API_KEY

pytestmark = pytest.mark.slow


def test_streams_closed_mid_flight_leave_no_page_behind(real_server):
    result = run(real_server.url, streams=200, concurrency=64, api_key=API_KEY)
    assert result["outcomes"] == {"closed": 200}
    assert result["after"] == result["before"] and result["after"]["dflash2_kv_cache_used_pages"] == 0
    reply = httpx.post(real_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
