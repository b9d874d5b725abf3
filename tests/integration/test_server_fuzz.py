"""Bodies generated from the server's own /openapi.json, valid and broken (wrong types, huge numbers, integers
over Python's 4,300 digits, deep nesting, lone surrogates, NaN, unknown fields), sent to the real server: never a
5xx, every 4xx an OpenAI-style error body on a connection that stays open, and afterwards the server serves a
normal request with no request or page left behind (issue 40's audit sent 7,126 such bodies; this sends a few
hundred, seeded, in well under a minute)."""
from __future__ import annotations

import http.client
import json
import random
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.server_process import API_KEY

pytestmark = pytest.mark.slow

SEED = 40
BODIES_PER_ROUTE = 120
RESPONSE_TIMEOUT_S = 30.0  # a body that generates long is cut off (the client hanging up aborts it)
HUGE_DIGITS = "9" * 5000
# fields whose generic values ("Hi", {}, 0) are never valid (a schema, a regex or grammar the prompt words do not
# make, tools, n <= best_of): left out of the valid bodies, so that most of them stay valid; wrong() still breaks them
_LEFT_OUT_OF_VALID = {"response_format", "guided_json", "guided_grammar", "guided_decoding_backend", "guided_choice",
                      "structured_outputs", "tools", "tool_choice", "best_of", "suffix", "logit_bias"}
_HUGE_MARK = "__huge_integer__"
_DEEP_MARK = "__deep_nesting__"


class BodyFuzzer:
    """Random JSON for an OpenAPI schema (its $refs resolved in `components`), and ways to break it."""

    def __init__(self, document: dict[str, Any], rng: random.Random) -> None:
        self.schemas = document["components"]["schemas"]
        self.rng = rng

    def valid(self, schema: dict[str, Any], depth: int = 0) -> Any:
        rng = self.rng
        if "$ref" in schema:
            return self.valid(self.schemas[schema["$ref"].rsplit("/", 1)[1]], depth)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return rng.choice(schema["enum"])
        if "anyOf" in schema:
            return self.valid(rng.choice(schema["anyOf"]), depth)
        kind = schema.get("type")
        if kind is None:  # a field of any type (those refused unless absent): wrong() gives it values
            return None
        if kind == "object":
            properties = schema.get("properties", {})
            required = set(schema.get("required", []))
            return {name: self.valid(sub, depth + 1) for name, sub in properties.items()
                    if name in required or (_typed(sub) and name not in _LEFT_OUT_OF_VALID and rng.random() < 0.25)}
        if kind == "array":
            count = max(schema.get("minItems", 0), rng.choice([0, 1, 1, 2, 3]))
            return [self.valid(schema.get("items", {}), depth + 1) for _ in range(count)]
        if kind == "string":
            return rng.choice(["Hi", "The capital of France is", "é ü 😀", "x" * rng.randint(1, 300), "user"])
        if kind == "integer":  # small: a valid body mostly stays valid (wrong() brings the rest)
            return rng.choice([schema.get("minimum", 0), 1, 2, 3])
        if kind == "number":
            return rng.choice([0.0, 0.5, 1.0])
        if kind == "boolean":
            return rng.random() < 0.5
        return None

    def wrong(self) -> Any:
        """A value of any type, often one no field takes."""
        return self.rng.choice([
            None, True, -1, 0, 2**63, -(2**63) - 1, 10**30, 1e308, -1e308, 1.5, 2.0, -0.0, "", "ten", "\ud800",
            "a\udfffb", [], [None], [2**64], [-1], [1.5], {}, {"\ud800": 1}, {"a": {"b": {"c": []}}}, [[[[[]]]]],
            float("nan"), float("inf"), "x" * 2000, _HUGE_MARK, _DEEP_MARK, ["\ud83d"], [{"type": "text"}]])

    def body(self, schema: dict[str, Any]) -> bytes:
        """One request body: valid, or with one to three fields broken, or not an object at all."""
        rng = self.rng
        body = self.valid(schema)
        roll = rng.random()
        if roll < 0.05:
            return self.encode(self.wrong())
        if roll < 0.75:
            properties = list(self.schemas[schema["$ref"].rsplit("/", 1)[1]].get("properties", {}))
            for name in rng.sample(properties, k=min(len(properties), rng.randint(1, 3))):
                body[name] = self.wrong()
            if rng.random() < 0.2:
                body[rng.choice(["foo", "x-extra", "\ud800key", ""])] = self.wrong()
        # generating requests stay short, so the run stays bounded: a valid token count (or none: up to the
        # context) becomes a few; the broken ones (0, -1, 2**63, 1.5, "ten", ...) stay
        if "max_tokens" in schema_properties(self.schemas, schema):
            for name in ("max_tokens", "max_completion_tokens"):
                value = body.get(name)
                if value is None or (type(value) in (int, float) and 4 < value < 2**31):
                    body[name] = rng.randint(1, 4)
        return self.encode(body)

    @staticmethod
    def encode(value: Any) -> bytes:
        text = json.dumps(value)  # ensure_ascii: lone surrogates become \ud800; NaN / Infinity as Python writes them
        text = text.replace(json.dumps(_HUGE_MARK), HUGE_DIGITS)
        return text.replace(json.dumps(_DEEP_MARK), "[" * 30_000 + "]" * 30_000).encode()


def _typed(schema: dict[str, Any]) -> bool:
    """Whether a field's schema names a type (the fields refused unless absent take any JSON: none named)."""
    return bool(schema.keys() & {"type", "anyOf", "$ref", "const", "enum"})


def schema_properties(schemas: dict[str, Any], schema: dict[str, Any]) -> set[str]:
    return set(schemas[schema["$ref"].rsplit("/", 1)[1]].get("properties", {}))


def assert_answered_well(status: int, data: bytes, path: str, body: bytes) -> None:
    where = f"{path} {body[:300]!r}"
    assert status < 500, f"{status} for {where}: {data[:500]!r}"
    if status >= 400:
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert "Traceback" not in error["message"] and "Error:" not in error["message"], error["message"]


def test_bodies_generated_from_the_openapi_document_never_get_a_5xx(real_server):
    document = httpx.get(real_server.url + "/openapi.json", timeout=30).json()  # open without the key
    routes = {path: item["post"]["requestBody"]["content"]["application/json"]["schema"]
              for path, item in document["paths"].items() if "requestBody" in item.get("post", {})}
    assert set(routes) == {"/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"}
    fuzzer = BodyFuzzer(document, random.Random(SEED))
    address = urlsplit(real_server.url)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=RESPONSE_TIMEOUT_S)
    counts: dict[int | str, int] = {}
    for path, schema in routes.items():
        for _ in range(BODIES_PER_ROUTE):
            body = fuzzer.body(schema)
            try:
                connection.request("POST", path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
            except TimeoutError:  # a valid, long generation: hang up (the server aborts it) and go on
                connection.close()
                counts["timeout"] = counts.get("timeout", 0) + 1
                continue
            assert_answered_well(response.status, data, path, body)
            counts[response.status] = counts.get(response.status, 0) + 1
            if 400 <= response.status < 413:  # a client error keeps the connection (a 413's unread body may not)
                assert connection.sock is not None, f"{response.status} closed the connection: {body[:200]!r}"
    connection.close()
    assert counts.get(200, 0) >= 50 and counts.get(400, 0) >= 300, counts
    ok = httpx.post(real_server.url + "/v1/completions", headers=headers, timeout=60,
                    json={"prompt": "The capital of France is", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    for metric in ("dflash2_num_requests_running", "dflash2_num_requests_waiting", "dflash2_kv_cache_used_pages"):
        assert real_server.wait_for_metric(metric, lambda v: v == 0) == 0, metric
