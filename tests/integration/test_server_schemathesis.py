"""Schemathesis against the real server's own /openapi.json (issue 47, item 4): every route, bodies generated from
its schema (bounded: a few examples a route, short generations), never a 5xx or a dropped connection; afterwards
the server serves a normal request with no page left behind. (The broken-body fuzzer is test_server_fuzz.py.)"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.integration.server_process import API_KEY

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 4  # generations stay short: the point is the input, not the output


def _bounded(case) -> None:
    """Generations stay short: the point is the input, not the output."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int):
                case.body[field] = min(case.body[field], MAX_TOKENS)
        if "max_tokens" not in case.body and case.path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            case.body["max_tokens"] = MAX_TOKENS


def test_no_generated_request_gets_a_server_error(real_server):
    # DELETE /v1/models/{name} is left out: a generated name could be the served model's
    schema = schemathesis.openapi.from_url(real_server.url + "/openapi.json").exclude(method="DELETE")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"}
    failures = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def call(case) -> None:
            _bounded(case)
            response = case.call(headers=AUTH, timeout=60)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
        call()
    assert failures == []


def test_the_server_serves_normally_after_the_generated_requests(real_server):
    reply = httpx.post(real_server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, headers=AUTH,
                       timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    assert real_server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == 0) == 0
