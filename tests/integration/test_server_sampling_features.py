"""n, best_of, logit_bias and suffix on the real server with the official client: choices, their indices in
streams, a banned token, and the bad values each a 400 that leaves the server serving with no page held."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.server_process import API_KEY

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def assert_no_page_held(server) -> None:
    assert server.wait_for_metric("dflash2_kv_cache_used_pages", lambda v: v == 0, model_name=MODEL) == 0


def test_n_greedy_choices_are_identical_and_usage_counts_the_prompt_once(client, real_server):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    single = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert {c.text for c in response.choices} == {single.choices[0].text}
    assert response.usage.prompt_tokens == single.usage.prompt_tokens
    assert response.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert_no_page_held(real_server)


def test_n_seeded_samples_differ_and_repeat(client):
    def texts() -> list[str]:
        response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0,
                                                  seed=1234, n=3)
        return [c.message.content for c in response.choices]

    first = texts()
    assert len(set(first)) == 3
    assert texts() == first


def test_n_streams_each_choice_with_its_index(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, seed=7, n=3)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, seed=7, n=3,
                                            stream=True, stream_options={"include_usage": True})
    texts, finishes, roles = ["", "", ""], {}, set()
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == [c.message.content for c in whole.choices]
    assert roles == {0, 1, 2} and set(finishes) == {0, 1, 2}
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    completions = client.completions.create(model=MODEL, prompt=[PROMPT, "One, two,"], max_tokens=4, temperature=0,
                                            n=2, stream=True)
    indices = {choice.index for chunk in completions for choice in chunk.choices}
    assert indices == {0, 1, 2, 3}  # prompt p's sample j is choice p * n + j


def test_best_of_returns_n_choices_of_the_highest_cumulative_logprob(client):
    best = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=2,
                                     best_of=4, logprobs=0)
    every = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=4,
                                      logprobs=0)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == every.usage.completion_tokens  # the four samples are billed


def test_logit_bias_minus_100_bans_the_token_greedy_picks(client, real_server):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    token_text = greedy.choices[0].text
    tokenized = httpx.post(real_server.url + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"prompt": token_text, "add_special_tokens": False}).json()
    [token_id] = tokenized["tokens"]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(token_id): -100})
    assert banned.choices[0].text != token_text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                          logit_bias={str(token_id): 100})
    assert chat.choices[0].message.content == token_text * 3


@pytest.mark.parametrize("route, extra, words", [
    ("completions", {"n": 17}, ("n must be at most 16", "--max-n")),
    ("chat", {"n": 17}, ("n must be at most 16",)),
    ("completions", {"best_of": 2, "n": 3}, ("best_of",)),
    ("completions", {"logit_bias": {"100": 100.5}}, ("logit_bias values must be in [-100, 100]",)),
    ("chat", {"logit_bias": {"100": -101}}, ("logit_bias values",)),
    ("completions", {"logit_bias": {"49152": 1}}, ("logit_bias keys must be token ids in [0, 49152)",)),
    ("chat", {"logit_bias": {"99999999999": 1}}, ("logit_bias keys",)),
    ("chat", {"logit_bias": {"x": 1}}, ("logit_bias keys must be token ids",)),
])
def test_bad_values_are_400_and_the_server_serves_on(client, real_server, route, extra, words):
    with pytest.raises(openai.BadRequestError) as error:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
    message = error.value.body["message"]
    assert all(word in message for word in words), message
    assert error.value.body["param"] == ("best_of" if "best_of" in extra else next(iter(extra)))
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2).choices[1].text is not None
    assert_no_page_held(real_server)


def test_suffix_on_a_model_without_fill_in_the_middle_is_400(client, real_server):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="def add(a, b):", suffix="    return c", max_tokens=4)
    assert "fill-in-the-middle template, and this model has none" in error.value.body["message"]
    assert error.value.body["param"] == "suffix"
    assert client.completions.create(model=MODEL, prompt="def add(a, b):", suffix="", max_tokens=2).choices
    assert_no_page_held(real_server)
