"""Abort storm (issue 47): many streams that the client closes mid-flight, against a running server; the page
counts must come back exactly where they started. Prints JSON.

    .venv/bin/python benchmarks/abort_storm.py --url http://127.0.0.1:8000 [--streams 1000] [--concurrency 200]
                                               [--api-key K] [--model NAME] [--output FILE]

Each stream asks for a long completion (ignore_eos), reads 1-3 of its events (seeded) and hangs up; up to
--concurrency are open at once. Before and after (once the server's request count is back to zero): the KV pages
used and the requests running and waiting, from /metrics.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

SETTLE_TIMEOUT_S = 60.0
GAUGES = ("dflash2_kv_cache_used_pages", "dflash2_num_requests_running", "dflash2_num_requests_waiting")


def gauges(url: str) -> dict[str, float]:
    """The pool's used pages and the requests running and waiting (summed over models)."""
    values = dict.fromkeys(GAUGES, 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], events_to_read: int) -> str:
    """One stream, closed after `events_to_read` events; how it ended."""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"http {response.status_code}"
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if line == "data: [DONE]":
                        return "finished"
                    if seen >= events_to_read:
                        return "closed"  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        return f"error {type(e).__name__}"
    return "ended early"


async def storm(url: str, streams: int, concurrency: int, api_key: str | None = None, model: str | None = None,
                seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"prompt": "Tell me a very long story about a dragon and a knight.", "max_tokens": 2000,
            "ignore_eos": True, "stream": True, **({"model": model} if model else {})}
    gate = asyncio.Semaphore(concurrency)
    outcomes: dict[str, int] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(headers=headers, timeout=120, limits=limits) as client:
        async def run(events: int) -> None:
            async with gate:
                outcome = await _one(client, url, body, events)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        await asyncio.gather(*(run(rng.randint(1, 3)) for _ in range(streams)))
    return outcomes


def settled(url: str, timeout_s: float = SETTLE_TIMEOUT_S) -> dict[str, float]:
    """The gauges once no request is running or waiting (or as they are after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    values = gauges(url)
    while (values["dflash2_num_requests_running"] or values["dflash2_num_requests_waiting"]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
        values = gauges(url)
    return values


def run(url: str, streams: int, concurrency: int, api_key: str | None = None, model: str | None = None
        ) -> dict[str, Any]:
    before = settled(url)
    started = time.monotonic()
    outcomes = asyncio.run(storm(url, streams, concurrency, api_key, model))
    seconds = time.monotonic() - started
    after = settled(url)
    return {"benchmark": "abort_storm", "streams": streams, "concurrency": concurrency, "seconds": round(seconds, 1),
            "outcomes": outcomes, "before": before, "after": after, "balanced": after == before}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    result = run(args.url, args.streams, args.concurrency, args.api_key, args.model)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0 if result["balanced"] else 1


if __name__ == "__main__":
    sys.exit(main())
