"""The express lane: an urgent prompt runs beside the main steps in flight (engine/express.py).

Pool and manager: the reserve kept from the main steps' allocations, and only settled pages and slots (none
that a main step in flight may touch) handed to the lane. Scheduler (test_scheduler.py's FakeEngine, which
checks the page accounting and every request's page contents after each operation): who takes the lane, what
stays untouched when it cannot, and the request joining the main steps after its prompt. Engine on the CPU
(the lane runs synchronously there): the same greedy tokens with and without the lane, through a real tiny
model, and every page back at the end.
"""
from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # the padded-graphs case runs the Triton backend in the interpreter

from dflash2.engine.kv.manager import KVManager  # noqa: E402
from dflash2.engine.kv.page_pool import PagePool  # noqa: E402
from dflash2.engine.plan import ScheduledChunk, StepPlan  # noqa: E402
from dflash2.request import Request  # noqa: E402
from dflash2.sampling_params import SamplingParams  # noqa: E402
from tests.unit.test_scheduler import FakeEngine, chunks, make_request  # noqa: E402


# -- the pool and the manager ----------------------------------------------------------------------------
def test_the_reserve_is_kept_from_the_main_allocations_and_open_to_the_lane() -> None:
    pool = PagePool(8, page_bytes=1)
    pool.reserved = 3
    assert pool.num_available == 5
    assert pool.allocate(6) is None
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    assert (pool.num_available, pool.num_free) == (0, 3)
    assert pool.allocate(1) is None
    assert sorted(pool.allocate_settled(3)) == [5, 6, 7]
    assert (pool.num_free, pool.num_used) == (0, 8)
    pool.check()


def test_a_page_released_while_a_step_is_in_flight_goes_to_the_lane_only_once_the_next_step_completed() -> None:
    pool = PagePool(4, page_bytes=1)
    pool.allocate(4)
    pool.launches, pool.completed = 5, 4  # step 5 in flight
    pool.release([2])  # step 5, or step 6 being planned, may still touch it
    assert pool.num_free == 1 and pool.num_available == 1  # the main steps may take it at once
    assert pool.num_settled_free() == 0 and pool.allocate_settled(1) is None
    pool.completed = 5
    assert pool.allocate_settled(1) is None
    pool.launches = pool.completed = 6
    assert pool.num_settled_free() == 1 and pool.allocate_settled(1) == [2]
    pool.check()


def test_the_reserve_is_refilled_from_the_least_recently_used_cached_pages_keeping_their_stamps() -> None:
    """With prefix caching most released pages become cached, not free: once the lane has taken reserved pages,
    the oldest cached pages are evicted into the free list at once (the ones the main steps would evict next),
    so the reserve is whole again; a refilled page is settled only once its own release has settled."""
    pool = PagePool(8, page_bytes=1)
    pool.reserved = 3
    pages = pool.allocate(5)  # [0..4]; 5, 6, 7 are the reserve
    for page, content in zip(pages, (b"a", b"b", b"c", b"d", b"e")):
        pool.register(page, content)
    pool.release([0, 1])  # released while step 1 is planned: settled once step 1 completed
    pool.launches = pool.completed = 1
    pool.release([2, 3])  # stamp 2
    assert (pool.num_free, pool.num_cached, pool.num_available) == (3, 4, 4)
    assert sorted(pool.allocate_settled(2)) == [5, 6]
    assert (pool.num_free, pool.num_cached, pool.num_used) == (3, 2, 3)  # 0 and 1, the oldest, refilled it
    assert pool.lookup(b"a") is None and pool.lookup(b"b") is None and pool.lookup(b"c") == 2
    assert pool.num_settled_free() == 3 and sorted(pool.allocate_settled(3)) == [0, 1, 7]
    assert (pool.num_free, pool.num_cached) == (2, 0)  # 2 and 3 now free, released at stamp 2: not settled yet
    assert pool.num_settled_free() == 0 and pool.allocate_settled(1) is None
    pool.launches = pool.completed = 2
    assert pool.num_settled_free() == 2
    assert pool.num_available == 0 and pool.allocate(1) is None  # the main steps never take the reserve
    pool.check()


def test_the_lane_gets_a_settled_slot_and_settled_pages() -> None:
    pool = PagePool(8, page_bytes=1)
    kv = KVManager(pool, 2, "m", max_slots=2)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    assert kv.grow(a, 3)
    a_pages, a_slot = list(kv.pages_of("a")), kv.slot_of("a")
    pool.launches = 1  # a's step is launched and not yet completed
    kv.free(a)
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=1))
    assert kv.has_settled_slot()
    assert kv.grow(b, 3, settled=True)
    assert kv.slot_of("b") != a_slot and set(kv.pages_of("b")).isdisjoint(a_pages)
    c = Request("c", [7], SamplingParams(max_tokens=1))
    assert not kv.has_settled_slot()  # the one free slot is a's, which step 1 may still read
    pool.launches = pool.completed = 2  # step 2 (the one planned when a was freed) completed
    kv.free(b)  # released at launches 2: settled once step 3 completed
    assert kv.has_settled_slot()  # a's slot
    assert kv.grow(c, 1, settled=True) and kv.slot_of("c") == a_slot
    pool.check()


# -- the scheduler -----------------------------------------------------------------------------------------
class LaneEngine(FakeEngine):
    """FakeEngine whose steps move the pool's launch counters as the engine does, and which plays the lane:
    take_express, write the prompt's KV into its pages, one fake token, express_done."""

    def step(self) -> StepPlan:
        self.pool.launches += 1
        plan = super().step()
        self.pool.completed = self.pool.launches
        return plan

    def express(self, max_tokens: int = 64, eligible=lambda request: True) -> ScheduledChunk | None:
        chunk = self.scheduler.take_express(max_tokens, eligible)
        if chunk is None:
            self.check()
            return None
        request = self.scheduler.express[chunk.request_id]
        pages = self.kv.pages_of(chunk.request_id)
        assert chunk.new_page_ids == tuple(pages[chunk.new_pages_start:])
        for position, token in enumerate(chunk.token_ids, chunk.start):
            self.device[pages[position // self.tokens_per_page]][position % self.tokens_per_page] = token
        self.rows[chunk.slot] = list(pages)
        self.scheduler.express_done(request)
        self.scheduler.on_step_done(StepPlan([chunk]))
        request.token_ids.append(1000 + request.num_tokens)
        self.check()
        self.check_contents()
        return chunk


def test_an_urgent_arrival_takes_the_lane_with_its_whole_prompt_and_then_decodes_in_the_main_steps() -> None:
    engine = LaneEngine(12, 2, max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk_size=4)
    a = make_request("a", [10, 11, 12], max_tokens=6)
    b = make_request("b", [20, 21], max_tokens=6)
    engine.add(a, b)
    engine.step()
    u = make_request("u", [30, 31, 32, 33, 34, 35], max_tokens=3, priority=9)
    engine.add(u)
    chunk = engine.express()
    # one chunk of the whole prompt (longer than prefill_chunk_size: the lane has its own limit), sampling
    assert (chunk.request_id, chunk.start, chunk.num_tokens, chunk.sample) == ("u", 0, 6, True)
    assert engine.running == ["a", "b", "u"] and engine.waiting == []
    assert u.num_computed_tokens == 6 and u.output_token_ids == [1006]
    assert u.first_scheduled_time is None  # the engine marks it, not the scheduler
    assert chunks(engine.step()) == [("u", 6, 1, True), ("a", 3, 1, True), ("b", 2, 1, True)]
    engine.run_to_completion()
    assert u.output_token_ids == [1006, 1007, 1008]
    assert engine.state[2] == 0  # no page used


def test_the_lane_is_left_alone_when_it_would_not_help_or_cannot_run() -> None:
    engine = LaneEngine(8, 2, max_num_seqs=3)
    a = make_request("a", [10, 11, 12], max_tokens=4, priority=5)
    engine.add(a)
    engine.step()
    state = engine.state
    same = make_request("s", [20, 21], max_tokens=2, priority=5)
    engine.add(same)
    assert engine.express() is None  # outranks nobody running: the next plan serves it as soon
    assert engine.express(eligible=lambda request: False) is None
    engine.scheduler.finish(same, same.status)
    long = make_request("l", [30, 31, 32, 33, 34], max_tokens=2, priority=9)
    engine.add(long)
    assert engine.express(max_tokens=4) is None  # 5 tokens: more than the lane takes
    assert engine.state == state and engine.waiting == ["l"] and not engine.kv.pages_of("l")
    engine.pool.reserved = 0
    engine.pool.launches += 1  # a step in flight: the pages released now are not the lane's yet
    hold = engine.pool.allocate(engine.pool.num_free)
    engine.pool.release(hold)
    assert engine.express() is None and engine.state == state
    engine.pool.completed = engine.pool.launches + 1
    engine.pool.launches += 1
    assert engine.express().request_id == "l"


def test_the_main_steps_pause_others_rather_than_take_the_lanes_reserve() -> None:
    engine = LaneEngine(6, 2, host_pages=8, max_num_seqs=4)
    engine.pool.reserved = 2
    a = make_request("a", [10, 11, 12, 13], max_tokens=4)
    b = make_request("b", [20, 21, 22, 23], max_tokens=4)
    engine.add(a, b)
    engine.step()  # a: 2 pages, b: 2 pages; 2 free, all reserved
    assert engine.running == ["a", "b"] and engine.pool.num_free == 2
    plan = engine.step()  # both need a third page: b (admitted last) is paused for a
    assert plan.preempted == ["b"] and chunks(plan) == [("a", 4, 1, True)]
    # b's two (hashed) pages went to the cache, and a's new page is one of them, evicted: 2 free pages stay
    assert engine.state == (2, 1, 3) and engine.kv.is_swapped("b")
    u = make_request("u", [30, 31, 32], max_tokens=2, priority=9)
    engine.add(u)
    engine.pool.completed = engine.pool.launches = engine.pool.launches + 1
    assert engine.express().request_id == "u"  # on the reserve
    engine.run_to_completion()
    assert engine.state[2] == 0


# -- the engine on the CPU, through a real tiny model --------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "eager+swap", "padded graphs, overlapped"])
def test_the_engine_gives_the_same_tokens_with_the_express_lane(tmp_path, mode) -> None:
    """Three bulk requests, then an urgent one: with the lane its prompt runs there (one launch), and every
    request's greedy tokens are the ones without it. "padded graphs": the main steps and the lane run at their
    graphs' padded shapes (eagerly here, captured on the GPU) with the Triton backend, overlapped, so the lane's
    one-chunk input block and future slot are the ones the GPU replays."""
    from dflash2 import LLM
    from dflash2.engine.express import lane_prefill_sizes
    from dflash2.engine.graphs import GraphLane, StepGraphs, graph_batch_sizes, mixed_graph_shapes
    from tests.tiny_models import build_tiny_model

    build_tiny_model("llama", str(tmp_path))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    graphs = mode.startswith("padded")
    if graphs:
        pytest.importorskip("triton")

    def run(express: bool) -> tuple[dict[str, list[int]], int]:
        extra = dict(attention_backend="triton", overlap=True) if graphs and express else {}
        llm = LLM(str(tmp_path), page_bytes=4096, prefill_chunk_size=8, max_num_batched_tokens=16,
                  kv_cache_memory=24 * 4096, max_model_len=64, max_num_seqs=4, express_lane=express,
                  express_max_tokens=16, express_reserve_tokens=8,
                  swap_space="1MiB" if mode.endswith("swap") else 0, **extra)
        engine = llm.engine
        if graphs and express:
            runner = engine.runner
            runner.graphs = StepGraphs(runner, graph_batch_sizes(4), mixed_graph_shapes(4, 16), capture=False)
            lane = GraphLane("express", engine.express.future_tokens, None)
            engine.express.graphs = StepGraphs(runner, [], [(0, p) for p in lane_prefill_sizes(16)], capture=False,
                                               lane=lane)
        for i in range(3):
            engine.add_request({"prompt_token_ids": [5 + i + j for j in range(12)]}, params, 0, f"bulk{i}")
        tokens: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished():
            if steps == 3:
                engine.add_request({"prompt_token_ids": [40 + j for j in range(14)]}, params, 100, "urgent")
            for output in engine.step():
                if output.finished:
                    tokens[output.request_id] = list(output.outputs[0].token_ids)
            steps += 1
        engine.pool.check()
        assert engine.pool.num_used == 0 and not engine.scheduler.express
        if graphs and express:
            assert sum(engine.express.graphs.replays.values()) == 1
        return tokens, engine.express.num_launches if engine.express is not None else 0

    expected, launches = run(False)
    assert launches == 0
    got, launches = run(True)
    assert launches == 1
    assert got == expected and sorted(got) == ["bulk0", "bulk1", "bulk2", "urgent"]


@pytest.mark.parametrize("overlap", [False, True])
def test_an_urgent_arrival_taken_while_a_step_waits_starts_in_the_lane_within_that_step(tmp_path, overlap) -> None:
    """The engine's wait hook (Engine.on_device_wait, the server's engine loop) takes an urgent request in while
    a step waits for its results: the lane runs its prompt within that same step() call (on the CPU the lane
    runs at once) and its first token comes out of that call, and every request's greedy tokens are the ones of
    a run that added it between steps without the lane. A request aborted from the hook is gone, pages and all."""
    from dflash2 import LLM
    from tests.tiny_models import build_tiny_model

    build_tiny_model("llama", str(tmp_path))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    urgent_prompt = {"prompt_token_ids": [40 + j for j in range(14)]}

    def run(hooked: bool) -> tuple[dict[str, list[int]], int, int, int]:
        llm = LLM(str(tmp_path), page_bytes=4096, prefill_chunk_size=8, max_num_batched_tokens=16,
                  kv_cache_memory=24 * 4096, max_model_len=64, max_num_seqs=4, express_lane=hooked,
                  express_max_tokens=16, express_reserve_tokens=8, overlap=overlap)
        engine = llm.engine
        for i in range(3):
            engine.add_request({"prompt_token_ids": [5 + i + j for j in range(12)]}, params, 0, f"bulk{i}")
        tokens: dict[str, list[int]] = {}
        calls, steps, came_in, first_token = 0, 0, None, None

        def take(outputs) -> None:
            nonlocal first_token
            for output in outputs:
                tokens.setdefault(output.request_id, []).extend(output.delta_token_ids)
                if output.request_id == "urgent" and first_token is None:
                    first_token = steps

        def hook(outputs) -> None:
            nonlocal calls, came_in
            calls += 1
            take(outputs)
            if calls == 4:
                engine.add_request(urgent_prompt, params, 100, "urgent")
                engine.add_request({"prompt_token_ids": [7, 8, 9]}, params, 100, "gone")
                came_in = steps
            elif calls == 5:
                engine.abort("gone")

        if hooked:
            engine.on_device_wait = hook
        while engine.has_unfinished():
            if not hooked and steps == 4:  # between steps instead
                engine.add_request(urgent_prompt, params, 100, "urgent")
                came_in = steps
            take(engine.step())
            steps += 1
        engine.pool.check()
        assert engine.pool.num_used == 0 and not engine.scheduler.express and "gone" not in engine.requests
        return tokens, came_in, first_token, engine.express.num_launches if engine.express is not None else 0

    expected, _, _, launches = run(False)
    assert launches == 0
    got, came_in, first_token, launches = run(True)
    assert launches == 1 and came_in is not None and first_token == came_in
    assert got == expected and sorted(got) == ["bulk0", "bulk1", "bulk2", "urgent"]


@pytest.mark.parametrize("flipped", [False, True])
def test_the_lane_takes_only_requests_at_least_express_min_priority_urgent(tmp_path, flipped) -> None:
    """express_min_priority (the client's convention): a middle-class request that outranks the bulk does not
    take the lane; a top-class one does (vLLM's convention flips both the priorities and the floor)."""
    from dflash2 import LLM
    from tests.tiny_models import build_tiny_model

    build_tiny_model("llama", str(tmp_path))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    bulk, middle, top, floor = (1000, 100, 0, 10) if flipped else (0, 100, 1000, 1000)
    llm = LLM(str(tmp_path), page_bytes=4096, prefill_chunk_size=8, max_num_batched_tokens=16,
              kv_cache_memory=24 * 4096, max_model_len=64, max_num_seqs=4, express_lane=True, express_max_tokens=16,
              express_reserve_tokens=8, express_min_priority=floor, low_priority_values_first=flipped)
    engine = llm.engine
    for i in range(2):
        engine.add_request({"prompt_token_ids": [5 + i + j for j in range(12)]}, params, bulk, f"bulk{i}")
    steps, taken, added = 0, [], {}
    while engine.has_unfinished():
        if steps == 2:
            added["middle"] = engine.add_request({"prompt_token_ids": [30 + j for j in range(10)]}, params, middle)
        if steps == 4:
            added["top"] = engine.add_request({"prompt_token_ids": [40 + j for j in range(10)]}, params, top)
        launches = engine.express.num_launches
        engine.step()
        if engine.express.num_launches > launches:
            taken.append(steps)
        steps += 1
    assert taken == [4]  # the top one only, at once
    assert added["top"].ran_in_express_lane and not added["middle"].ran_in_express_lane  # (the request log's)
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_urgent_arrivals_in_a_stream_do_not_hold_the_main_steps_for_more_than_one_lane_prompt(tmp_path) -> None:
    """The main steps wait for the lane's prompt at the start of a step() call; arrivals taken in during that
    wait do not start further lane prompts there (a stream of them would hold the main steps for good). So a
    call runs at most three: the one it waits for, and one in each wait for a main step's results (the step in
    flight, and the step committed at once for an urgent first token); and every call launches a main step."""
    from dflash2 import LLM
    from tests.tiny_models import build_tiny_model

    build_tiny_model("llama", str(tmp_path))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(str(tmp_path), page_bytes=4096, prefill_chunk_size=8, max_num_batched_tokens=16,
              kv_cache_memory=48 * 4096, max_model_len=64, max_num_seqs=8, express_lane=True,
              express_max_tokens=16, express_reserve_tokens=16, overlap=True)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": list(range(5, 17))}, params, 0, "bulk")
    added = []

    def hook(outputs) -> None:  # two urgent arrivals every time the engine looks (one waits for the lane)
        for _ in range(2):
            if len(added) < 8:
                added.append(engine.add_request({"prompt_token_ids": [40 + len(added), 41, 42]}, params, 100,
                                                f"u{len(added)}").request_id)

    engine.on_device_wait = hook
    per_call, main_steps = [], []
    while engine.has_unfinished():
        launches, steps = engine.express.num_launches, engine.pool.launches
        engine.step()
        per_call.append(engine.express.num_launches - launches)
        main_steps.append(engine.pool.launches - steps)
    assert max(per_call) <= 3 and sum(per_call) >= 3  # (without the bound: 6 in one call)
    assert all(main_steps[:-1])
    assert engine.pool.num_used == 0
