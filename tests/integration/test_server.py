"""The real server on the bundled model, over HTTP: the official openai client, SSE, /generate, metrics,
client disconnects, and `dflash2 bench` against it. Greedy text over HTTP equals the offline API's."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import openai
import pytest

from dflash2 import SamplingParams
from tests.integration.server_process import API_KEY, console_script

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def offline_text(llm, prompt: str, max_tokens: int) -> str:
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))[0].outputs[0].text


def sse_events(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_answered_503_while_loading_then_200(real_server):
    assert 503 in real_server.health_codes
    assert real_server.health_codes[-1] == 200
    assert httpx.get(real_server.url + "/version").json()["version"]


def test_models_lists_the_bundled_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_greedy_text_equals_offline_text(client, bundled_llm_float):
    expected = offline_text(bundled_llm_float, PROMPT, 16)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason in ("stop", "length")
    prompt_tokens = len(bundled_llm_float.tokenizer.encode(PROMPT))
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.total_tokens == prompt_tokens + response.usage.completion_tokens


def test_completion_stream_matches_and_reports_usage(client, bundled_llm_float):
    expected = offline_text(bundled_llm_float, PROMPT, 16)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_and_streamed_text_equal_offline_chat(client, bundled_llm_float):
    expected = bundled_llm_float.chat(CHAT, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.model_dump()["total_tokens"] == whole.usage.total_tokens


def test_sse_wire_format_is_openai_shaped(real_server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", real_server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        assert event["object"] == "text_completion" and event["model"] == MODEL
        assert set(event["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}


def test_concurrent_requests_each_get_their_offline_text(real_server, bundled_llm_float):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]
    expected = [offline_text(bundled_llm_float, p, 12) for p in prompts]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
            responses = await asyncio.gather(*[
                http.post(real_server.url + "/v1/completions",
                          json={"prompt": p, "max_tokens": 12, "temperature": 0}) for p in prompts])
        return [r.json()["choices"][0]["text"] for r in responses]

    assert asyncio.run(run()) == expected


def test_generate_text_token_ids_and_stream(real_server, bundled_llm_float):
    offline = bundled_llm_float.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "top_p": 1.0, "top_k": 0, "seed": 1,
            "priority": 1000}
    whole = httpx.post(real_server.url + "/generate", json=body, headers=AUTH, timeout=60).json()
    assert whole["text"] == offline.text and whole["token_ids"] == offline.token_ids
    assert whole["priority"] == 1000
    ids_body = {"prompt_token_ids": bundled_llm_float.tokenizer.encode(PROMPT), "max_tokens": 8, "temperature": 0,
                "stream": True}
    with httpx.stream("POST", real_server.url + "/generate", json=ids_body, headers=AUTH, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["token_ids"]] == offline.token_ids
    assert "".join(e["text"] for e in events[:-1]) == offline.text
    assert events[-2]["usage"]["completion_tokens"] == len(offline.token_ids)


def test_priority_reaches_the_scheduler_from_every_endpoint(client, real_server):
    ids = [(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      extra_body={"priority": 65535}).id, 65535),
           (client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                           extra_body={"priority": 7}).id, 7)]
    generated = httpx.post(real_server.url + "/generate", json={"prompt": PROMPT, "max_tokens": 2, "priority": 100},
                           headers=AUTH, timeout=60).json()
    ids.append((generated["id"], 100))
    default = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    ids.append((default.id, 0))
    time.sleep(0.2)
    records = {r["request_id"]: r for r in real_server.json_logs() if r.get("event") == "request_finished"}
    for request_id, priority in ids:
        assert records[request_id]["priority"] == priority  # read from the engine's Request


def test_request_log_splits_the_http_side_from_the_engine(client, real_server):
    """Each request's log line says how long the HTTP side held it before the engine thread had it (http_in_ms)
    and, when streamed, from the engine's first token to its write to the stream (http_out_ms)."""
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    time.sleep(0.2)
    records = {r["request_id"]: r for r in real_server.json_logs() if r.get("event") == "request_finished"}
    streamed_record, whole_record = records[streamed[0].id], records[whole.id]
    assert streamed_record["http_in_ms"] >= 0 and streamed_record["http_out_ms"] >= 0
    assert whole_record["http_in_ms"] >= 0 and "http_out_ms" not in whole_record  # not streamed


def test_a_client_ttft_splits_into_sending_the_app_and_the_way_back(real_server):
    """W3's breakdown (benchmarks/w3_server.py): the bench client's send time and the server log's monotonic
    instants (received, first tokens written) share the host's clock, so the three parts are each >= 0 and add
    up to the client's TTFT."""
    from benchmarks.w3_server import request_log, ttft_breakdown
    from dflash2.bench.client import send_raw
    from dflash2.bench.dataset import BenchItem

    headers = {"Authorization": f"Bearer {API_KEY}"}
    results = [asyncio.run(send_raw(real_server.url, "/v1/completions", BenchItem(PROMPT, 3, 1000), MODEL, True,
                                    headers)) for _ in range(3)]
    assert all(r.ok and r.request_id.startswith("cmpl-") for r in results)
    time.sleep(0.2)
    summary = ttft_breakdown(request_log(str(real_server.stdout_path)), results)
    assert summary["requests"] == 3 and len(summary["slowest"]) == 3
    for row in summary["slowest"]:
        parts = (row["before_app"], row["in_app"], row["after_write"])
        assert min(parts) >= 0 and abs(sum(parts) - row["ttft_ms"]) <= 0.3  # each part rounded to 0.1 ms


def test_vllm_extra_sampling_fields(client, bundled_llm_float):
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "min_tokens": 10, "top_k": 5,
                                                   "repetition_penalty": 1.1})
    assert forced.usage.completion_tokens == 10
    greedy_ids = bundled_llm_float.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                        extra_body={"stop_token_ids": [greedy_ids[1]]})
    assert stopped.usage.completion_tokens == 2 and stopped.choices[0].finish_reason == "stop"
    seeded = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=123)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_logprobs_whole_and_streamed(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert "".join(logprobs.tokens) == whole.choices[0].text and len(logprobs.tokens) == 6
    assert all(len(top) <= 2 and max(top.values()) <= 0.0 for top in logprobs.top_logprobs)
    streamed = [t for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                      logprobs=2, stream=True) if c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)


def test_tokenize_and_detokenize(real_server, bundled_llm_float):
    tokens = httpx.post(real_server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert tokens["tokens"] == bundled_llm_float.tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 1024
    text = httpx.post(real_server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json()
    assert text["prompt"] == PROMPT
    chat = httpx.post(real_server.url + "/tokenize", json={"messages": CHAT}, headers=AUTH).json()
    assert chat["tokens"] == bundled_llm_float.apply_chat_template(CHAT)


def test_metrics_are_labelled_and_count_requests(real_server, client):
    before = real_server.metric("dflash2_generation_tokens_total", model_name=MODEL) or 0.0
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(real_server.url + "/metrics").text  # open without the API key
    for name in ("dflash2_num_requests_running", "dflash2_num_requests_waiting", "dflash2_kv_cache_usage_perc",
                 "dflash2_prompt_tokens_total", "dflash2_generation_tokens_total", "dflash2_num_preemptions_total",
                 "dflash2_request_success_total", "dflash2_time_to_first_token_seconds_bucket",
                 "dflash2_inter_token_latency_seconds_bucket", "dflash2_e2e_request_latency_seconds_bucket",
                 "dflash2_request_queue_time_seconds_bucket", "dflash2_request_prefill_time_seconds_bucket",
                 "dflash2_request_decode_time_seconds_bucket", "dflash2_scheduler_latency_microseconds_bucket",
                 "dflash2_kv_cache_hit_ratio", "dflash2_cache_eviction_rate", "dflash2_streaming_timeout_total",
                 "dflash2_streaming_success_total", "dflash2_gc_pause_seconds_bucket",
                 "dflash2_server_gc_pause_seconds_bucket"):  # (the engine's process, and the HTTP server's)
        assert f'{name}{{' in text and f'model_name="{MODEL}"' in text, name
    assert "dflash2_gpu_memory_utilization{" not in text  # declared, but no sample on the CPU
    assert "# TYPE dflash2_gpu_memory_utilization gauge" in text
    after = real_server.metric("dflash2_generation_tokens_total", model_name=MODEL)
    assert after >= before + 3
    # every step's host time is split into launch and finish (waiting for results, committing): one sample each
    from prometheus_client.parser import text_string_to_metric_families

    samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name.startswith("dflash2_step_")}
    steps = samples["dflash2_step_duration_seconds_count"]
    for part in ("dflash2_step_launch_seconds", "dflash2_step_finish_seconds"):
        assert samples[part + "_count"] == steps >= 3
        assert samples[part + "_sum"] > 0
    assert real_server.metric("dflash2_request_success_total", model_name=MODEL, finished_reason="length") >= 1


def test_scrapes_while_requests_stream_answer_whole_and_leave_the_output_unchanged(real_server, client, bundled_llm_float):
    """The engine process renders each scrape on a thread of its own: the replies are whole expositions whose
    token counter only grows, and the streams beside them produce the offline API's greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client.parser import text_string_to_metric_families

    def stream() -> str:
        chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(chunk.choices[0].text for chunk in chunks)

    def generated(text: str) -> float:
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == "dflash2_generation_tokens_total")

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream) for _ in range(3)]
        counts = []
        while not all(f.done() for f in streams) or len(counts) < 3:
            counts.append(generated(httpx.get(real_server.url + "/metrics", timeout=30).text))
        texts = [f.result() for f in streams]
    assert counts == sorted(counts) and counts[0] > 0
    assert texts == [offline_text(bundled_llm_float, PROMPT, 24)] * 3


def test_client_disconnect_aborts_and_frees_pages(real_server):
    used_before = real_server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == 0, model_name=MODEL)
    aborts_before = real_server.metric("dflash2_request_success_total", model_name=MODEL, finished_reason="abort")
    body = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 800, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", real_server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        num_events, used_during = 0, None
        for line in r.iter_lines():
            num_events += line.startswith("data: ")
            if num_events == 3:
                used_during = real_server.metric("dflash2_kv_cache_used_pages", model_name=MODEL)
                break  # dropping the line iterator closes the connection mid-stream
    assert used_during > used_before
    aborts = real_server.wait_for_metric("dflash2_request_success_total", lambda v: v >= aborts_before + 1,
                                         model_name=MODEL, finished_reason="abort")
    assert aborts == aborts_before + 1
    used_after = real_server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == used_before,
                                             model_name=MODEL)
    assert used_after == used_before
    assert real_server.metric("dflash2_num_requests_running", model_name=MODEL) == 0


def test_client_that_gives_up_on_a_whole_answer_aborts_it(real_server):
    used_before = real_server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == 0, model_name=MODEL)
    aborts_before = real_server.metric("dflash2_request_success_total", model_name=MODEL, finished_reason="abort")
    body = {"prompt": "Count to a thousand.", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(real_server.url + "/generate", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=1.0))
    assert real_server.wait_for_metric("dflash2_request_success_total", lambda v: v == aborts_before + 1,
                                       model_name=MODEL, finished_reason="abort") == aborts_before + 1
    assert real_server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == used_before,
                                       model_name=MODEL) == used_before


def test_bench_against_the_server(real_server, tmp_path):
    report_path = tmp_path / "report.json"
    result = subprocess.run(
        [*console_script("dflash2-bench", "bench"), "--url", real_server.url, "--duration", "3", "--concurrency", "4",
         "--max-tokens", "6", "--ignore-eos", "--api-key", API_KEY, "--timeout", "120", "--output", str(report_path),
         "--no-progress"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["completed"] >= 1 and report["failed"] == 0 and report["error_rate"] == 0.0
    for field in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                  "mean_tpot_ms", "p95_itl_ms", "p99_e2el_ms", "latency_p50", "latency_p95", "latency_p99",
                  "ttft_p50", "ttft_p95", "ttft_p99"):
        assert report[field] is not None and report[field] >= 0, field
    assert report["throughput"]["output_tokens_per_s"] > 0
    assert report["total_output_tokens"] == 6 * report["completed"]
    assert report["gpu_utilization_avg"] is None  # CPU server
    assert set(report["per_priority"]) <= {"0", "100", "1000"}
    assert sum(s["completed"] for s in report["per_priority"].values()) == report["completed"]


def test_bench_sweep_writes_a_chart(real_server, tmp_path):
    output = tmp_path / "sweep.json"
    result = subprocess.run(
        [*console_script("dflash2-bench", "bench"), "--url", real_server.url, "--sweep", "1,2", "--num-prompts", "2",
         "--max-tokens", "3", "--ignore-eos", "--api-key", API_KEY, "--output", str(output), "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(output.read_text())
    assert [level["concurrency"] for level in report["sweep"]] == [1, 2]
    assert report["knee_concurrency"] in (1, 2)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_split_by_priority_runs_each_class_in_its_own_client(real_server):
    """W3's Poisson overload from one client process per priority (benchmarks/priority.py): every request of
    the cycled dataset is sent once, by its class's process, and each completes."""
    from collections import Counter

    from dflash2.bench.dataset import BenchItem
    from dflash2.bench.load import LoadConfig, run_per_priority

    items = [BenchItem(PROMPT, 3, priority) for priority in (0, 0, 0, 100, 1000)]
    config = LoadConfig(url=real_server.url, num_prompts=9, request_rate=20.0, api_key=API_KEY, ignore_eos=True,
                        progress=False, timeout_s=120)
    load = run_per_priority(config, items)
    assert [r.error for r in load.results if not r.ok] == []
    assert Counter(r.priority for r in load.results) == Counter({0: 6, 100: 2, 1000: 1})
    assert [r.output_tokens for r in load.results] == [3] * 9
    assert load.duration_s > 0
    with pytest.raises(ValueError, match="request-rate"):
        run_per_priority(LoadConfig(url=real_server.url, num_prompts=2), items)
