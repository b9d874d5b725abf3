"""The KV tiers (issue 43) on the bundled model, fp32, a device pool of 4 pages: conversations larger than the
device pool get their evicted pages back from host memory (L2) and from disk files (L3) on their next turn, with
the tokens they would have had with no tiers; a new engine on the same directory starts warm; corrupt and cut
files are misses; a directory that fails under the engine turns writing off and serving goes on."""
from __future__ import annotations

from pathlib import Path

import pytest

from dflash2 import LLM, SamplingParams
from dflash2.engine.engine import Engine
from dflash2.engine.kv.prefix_hash import chain_hashes

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FIRST = "The history of the city goes back many centuries, to a small village by the river where fishermen"
OTHERS = ["Write a poem about the sea and the wind and the stars above the quiet harbour at night time.",
          "List the planets of the solar system in order from the sun, with one fact about each of them.",
          "Explain how a bicycle stays upright while it moves, in words a child of ten would understand.",
          "Describe the smell of bread baking early in the morning in a small bakery on a cold winter day."]
OPTIONS = dict(dtype="float32", max_num_seqs=2, kv_cache_memory="4MiB", max_model_len=80)


def _checked_steps(engine: Engine) -> None:
    """Check the page accounting of every tier after every step of `engine` (its own checks, run each step)."""
    step = engine.step

    def checked_step():
        outputs = step()
        engine.pool.check()
        if engine.host_pool is not None:
            engine.host_pool.check()
        if engine.disk_tier is not None:
            engine.disk_tier.check()
        return outputs

    engine.step = checked_step


def _first_turn(llm: LLM):
    return llm.generate(FIRST, GREEDY)[0]


def _second_turn(llm: LLM, first) -> tuple[list[int], int]:
    prompt = first.prompt_token_ids + list(first.outputs[0].token_ids) + llm.tokenizer.encode(" Then")
    second = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    return second.outputs[0].token_ids, second.num_cached_tokens


def _conversation(llm: LLM) -> tuple[list[list[int]], int]:
    """Turn one, other prompts (two at a time) that take the device's (and the host's) pages, turn two (turn one and its
    answer, and more); every answer's tokens and turn two's reused prompt tokens."""
    _checked_steps(llm.engine)
    first = _first_turn(llm)
    others = [o.outputs[0].token_ids for pair in (OTHERS[:2], OTHERS[2:]) for o in llm.generate(pair, GREEDY)]
    second, reused = _second_turn(llm, first)
    return [first.outputs[0].token_ids, *others, second], reused


@pytest.fixture(scope="module")
def without_tiers() -> tuple[list[list[int]], int]:
    with LLM(**OPTIONS) as llm:
        return _conversation(llm)


def test_a_later_turn_gets_its_evicted_pages_back_from_host_memory(without_tiers):
    with LLM(**OPTIONS, swap_space="64MiB") as llm:
        with_l2, reused = _conversation(llm)
        kv = llm.engine.kv
        assert kv.num_prefix_hits_disk == 0 and reused == kv.num_prefix_hits_host > 0
    assert with_l2 == without_tiers[0]  # the same tokens
    assert without_tiers[1] == 0  # with no tiers, turn two computed its whole prompt


def test_a_later_turn_gets_its_pages_back_from_disk_when_host_memory_is_full_too(without_tiers, tmp_path):
    """One host page: the other prompts push turn one's pages out of host memory too; they were written
    through to disk, and turn two reads them back (checked) instead of computing them."""
    with LLM(**OPTIONS, swap_space="1MiB", l3_cache_path=str(tmp_path)) as llm:
        with_l3, reused = _conversation(llm)
        kv, store = llm.engine.kv, llm.engine.disk_tier.store
        assert kv.num_prefix_hits_disk > 0 and reused == kv.num_prefix_hits_disk + kv.num_prefix_hits_host
        assert store.bytes_written > 0 and store.num_reads > 0 and store.num_corrupt == 0
        prompt_tokens = len(llm.tokenizer.encode(FIRST)) + 8 + 1
        assert reused == (prompt_tokens - 1) // kv.tokens_per_page * kv.tokens_per_page  # every full page
    assert with_l3 == without_tiers[0]


def test_a_new_engine_on_the_same_directory_starts_warm_and_misses_corrupt_or_cut_files(without_tiers, tmp_path):
    """The first engine serves turn one and closes (writing its pages down); a second one on the same directory
    gets them back for turn two, same tokens. Then the page's file gets flipped bytes, and (written again by
    the next engine's close) is cut short: each time the next engine finds it out (counted, removed), computes
    the turn instead, and its tokens are still equal."""
    options = dict(OPTIONS, swap_space="1MiB", l3_cache_path=str(tmp_path))
    with LLM(**options) as llm:
        first = _first_turn(llm)
        kv, tokens = llm.engine.kv, first.prompt_token_ids + list(first.outputs[0].token_ids)
        page_file = tmp_path / llm.engine.disk_tier._fingerprints[kv.namespace] / (
            chain_hashes(tokens, kv.tokens_per_page, kv.namespace)[0].hex() + ".page")  # its one full page
    assert page_file.exists(), "closing wrote the cached pages down"
    with LLM(**options) as llm:
        _checked_steps(llm.engine)
        second, reused = _second_turn(llm, first)
        assert reused == llm.engine.kv.num_prefix_hits_disk > 0
    assert second == without_tiers[0][-1]
    for damage in (_flip_a_byte, _cut):
        damage(page_file)
        with LLM(**options) as llm:
            _checked_steps(llm.engine)
            second, reused = _second_turn(llm, first)
            assert llm.engine.disk_tier.store.num_corrupt == 1 and reused == 0
        assert second == without_tiers[0][-1]
        assert page_file.exists()  # written again, whole, when that engine closed


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def test_a_directory_failing_under_the_engine_turns_writing_off_and_serving_goes_on(without_tiers, tmp_path):
    """The directory is taken away after startup: the first write fails, writing turns off (one log line), and
    the conversation's tokens are still right (from host memory where it can, computed where not)."""
    with LLM(**OPTIONS, swap_space="1MiB", l3_cache_path=str(tmp_path)) as llm:
        tmp_path.rmdir()
        tmp_path.write_text("not a directory any more")
        tokens, _ = _conversation(llm)
        assert llm.engine.disk_tier.store.writes_disabled
    assert tokens == without_tiers[0]


def test_the_disk_tier_needs_host_memory_and_an_existing_directory(tmp_path):
    with pytest.raises(ValueError, match="swap space"):
        LLM(**OPTIONS, l3_cache_path=str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(**OPTIONS, swap_space="1MiB", l3_cache_path=str(tmp_path / "missing"))


def _paused_run(options: dict) -> tuple[list[list[int]], dict[str, int]]:
    """Two long requests run; two urgent ones arrive one after the other, each pausing one of them; every
    request's tokens, in arrival order, and the counts of swaps, spills and host and disk hits."""
    with LLM(**options) as llm:
        engine = llm.engine
        _checked_steps(engine)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        low = [engine.add_request(FIRST + " " + text, params) for text in OTHERS[:2]]
        for _ in range(6):
            engine.step()
        urgent = []
        for text in OTHERS[2:]:
            urgent.append(engine.add_request(text, params, priority=10))
            for _ in range(2):
                engine.step()
        while engine.has_unfinished():
            engine.step()
        assert engine.pool.num_used == 0 and engine.host_pool.num_swapped == 0
        kv = engine.kv
        counts = dict(swaps=engine.scheduler.num_swap_outs, spills=kv.num_spills, host=kv.num_prefix_hits_host,
                      disk=kv.num_prefix_hits_disk)
        return [request.output_token_ids for request in low + urgent], counts


def test_a_paused_request_spills_to_disk_when_host_memory_is_full_of_paused_ones(tmp_path):
    """Host memory holds one paused request's pages: the second pause finds it full, so the first paused
    request's full pages go to the prefix cache and down to disk (spilled), and it comes back through a prefix hit
    instead of computing its tokens again; the tokens are those of a run where both pauses swap."""
    options = dict(OPTIONS, kv_cache_memory="6MiB", max_model_len=120)
    swapped, counts = _paused_run(dict(options, swap_space="16MiB"))
    assert counts == dict(swaps=2, spills=0, host=0, disk=0)
    with LLM(**options) as llm:
        pages = llm.engine.kv.num_pages_for(len(llm.tokenizer.encode(FIRST + " " + OTHERS[0])) + 10)
    spilled, counts = _paused_run(dict(options, swap_space=f"{pages}MiB", l3_cache_path=str(tmp_path)))
    assert counts["swaps"] == 1 and counts["spills"] == 1 and counts["host"] + counts["disk"] > 0
    assert spilled == swapped
