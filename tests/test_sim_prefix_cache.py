"""vLLM's automatic prefix caching in the simulated node, pinned on hand-computed cases (block size 4)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.profiles import PROFILES
from gpu_probe.parse import parse
from kvgate.dev.stack import free_port, wait_port
from sim.engine import Engine, EngineOptions, simulate
from sim.prefix_cache import BlankRun, Block, Prompt
from sim.scheduler import Plan, Request, Scheduler, SchedulerConfig, Status
from tests.helpers import get, post


def sched(blocks: int = 100, budget: int = 64, seqs: int = 8, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=blocks, block_size=4, max_num_batched_tokens=budget,
                                     max_num_seqs=seqs, enable_prefix_caching=caching))


def R(name: str, ids: list[int] | range, out: int = 2) -> Request:
    return Request(name, len(ids), out, 0.0, content=Prompt.from_ids(list(ids)))


def step(s: Scheduler, t: float = 0.0) -> Plan:
    plan = s.schedule(t)
    s.finish_step(plan, t + 0.5)
    return plan


def run(s: Scheduler, *reqs: Request) -> list[Plan]:
    """Add the requests and step until all of them are done; the plans of every step."""
    for r in reqs:
        s.add(r)
    plans: list[Plan] = []
    while any(r.status is not Status.FINISHED for r in reqs):
        plans.append(step(s, float(len(plans))))
    return plans


def test_a_repeated_prompt_hits_its_full_blocks_and_computes_the_rest() -> None:
    s = sched()
    first = run(s, R("a", range(10)))
    assert first[0].prefill_tokens == 10 and s.prefix_hits == 0 and s.prefix_queries == 10
    b = R("b", range(10))
    s.add(b)
    plan = step(s)
    # 10 tokens = 2 full blocks + 2: both full blocks hit, 2 tokens computed, attention over all 10
    assert b.cached_tokens == 8 and plan.prefill_tokens == 2 and plan.context_tokens == 10
    assert (s.prefix_queries, s.prefix_hits) == (20, 8)


def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    s = sched()
    run(s, R("a", range(8)))  # 2 full blocks, both cached
    b = R("b", range(8))
    s.add(b)
    plan = step(s)
    # never the last token from cache: at most 7 tokens, in whole blocks → 1 block; 4 tokens computed
    assert b.cached_tokens == 4 and plan.prefill_tokens == 4
    c = R("c", range(9))  # one token more: both blocks hit, 1 computed
    s.add(c)
    plan = step(s, 1.0)
    assert c.cached_tokens == 8 and dict((r.id, n) for r, n in plan.scheduled)["c"] == 1


def test_a_partial_shared_prefix_hits_only_the_shared_full_blocks() -> None:
    s = sched()
    run(s, R("a", range(12)))
    b = R("b", [0, 1, 2, 3, 4, 5, 99, 98, 97, 96, 95, 94])  # shares 6 tokens: block 0 only
    s.add(b)
    assert step(s).prefill_tokens == 8 and b.cached_tokens == 4
    c = R("c", [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # differs in token 0: the chain breaks at block 0
    s.add(c)
    step(s, 1.0)
    assert c.cached_tokens == 0


def test_prompts_within_one_block_never_hit() -> None:
    s = sched()
    for ids in ([1, 2, 3], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]):  # a lone full block is the last block
        r = R("x", ids)
        run(s, r)
        assert r.cached_tokens == 0
    assert s.prefix_hits == 0 and s.prefix_queries == 14


def test_the_cache_salt_keys_the_first_block() -> None:
    s = sched()
    run(s, Request("a", 9, 1, 0.0, content=Prompt.from_ids(list(range(9)), salt="tenant-a")))
    same = Request("b", 9, 1, 0.0, content=Prompt.from_ids(list(range(9)), salt="tenant-a"))
    other = Request("c", 9, 1, 0.0, content=Prompt.from_ids(list(range(9)), salt="tenant-b"))
    bare = R("d", range(9), out=1)
    run(s, same, other, bare)
    assert (same.cached_tokens, other.cached_tokens, bare.cached_tokens) == (8, 0, 0)


def test_a_running_request_shares_its_blocks_and_a_hit_allocates_only_the_rest() -> None:
    s = sched(blocks=10)
    a = R("a", range(9), out=10)
    s.add(a)
    step(s)  # a: 3 blocks (2 full, hashed), still running
    assert s.free_blocks == 7
    b = R("b", range(9), out=10)
    s.add(b)
    step(s, 1.0)
    # b hit a's 2 blocks (in use: no free block consumed for them) and took 1 new one; a grew by none
    assert b.cached_tokens == 8 and s.free_blocks == 6 and b.blocks == 3
    assert [x.ref for x in b.hashed] == [2, 2]


def test_lru_eviction_takes_the_least_recently_freed_tail_first() -> None:
    s = sched(blocks=4)
    run(s, R("a", range(8), out=1))  # 2 blocks, both hashed, freed at once: tail first → queue [blank x2, a1, a0]
    run(s, R("b", range(100, 108), out=1))  # takes the 2 blank ones, then freed → queue [a1, a0, b1, b0]
    assert s.free_blocks == 4 and s.evictable_blocks == 4
    a, b = R("a?", range(9)), R("b?", range(100, 109))
    assert (s.cache_hit_tokens(a), s.cache_hit_tokens(b)) == (8, 8)
    run(s, R("c", [50, 51, 52], out=1))  # 1 block: evicts a1, a's tail
    assert s.evictable_blocks == 3  # c's partial block is blank: queue [a0, b1, b0, blank]
    assert (s.cache_hit_tokens(a), s.cache_hit_tokens(b)) == (4, 8)
    run(s, R("d", [60, 61, 62, 63, 64], out=1))  # 2 blocks: a0, then b's tail b1
    assert (s.cache_hit_tokens(a), s.cache_hit_tokens(b)) == (0, 4)
    assert s.evictable_blocks == 2 and s.free_blocks == 4  # b0, and d's own full first block


def test_a_block_in_use_is_never_evicted() -> None:
    s = sched(blocks=4)
    run(s, R("a", range(8), out=1))  # free queue: [blank x2, a1, a0]
    d = R("d", range(9), out=5)  # hits a0 and a1 (out of the free queue), 1 new block
    s.add(d)
    step(s)
    assert d.cached_tokens == 8 and s.free_blocks == 1 and s.evictable_blocks == 0
    e = R("e", [60, 61, 62], out=3)
    s.add(e)
    step(s, 1.0)
    assert s.free_blocks == 0
    f = R("f", [70, 71, 72], out=1)
    s.add(f)
    step(s, 2.0)
    assert f.status is Status.WAITING  # no free block: d's cached blocks are not up for eviction
    assert [x.ref for x in d.hashed[:2]] == [1, 1] and s.cached_blocks >= 2


def test_caching_off_never_hits() -> None:
    s = sched(caching=False)
    run(s, R("a", range(10)))
    b = R("b", range(10))
    s.add(b)
    assert step(s).prefill_tokens == 10
    assert b.cached_tokens == 0 and s.cached_blocks == 0 and s.prefix_queries == 0


def test_a_request_without_content_never_hits_and_caches_nothing() -> None:
    s = sched()
    run(s, Request("a", 10, 2, 0.0))
    b = Request("b", 10, 2, 0.0)
    s.add(b)
    assert step(s).prefill_tokens == 10
    assert s.cached_blocks == 0 and s.evictable_blocks == 0 and (s.prefix_queries, s.prefix_hits) == (20, 0)


def test_a_preempted_request_hits_its_own_blocks_and_counts_apart() -> None:
    s = sched(blocks=9, budget=64)
    a, b = R("a", range(8), out=20), R("b", range(100, 108), out=20)
    plans = run(s, a, b)
    # b (the newest) is preempted when both want a 5th block, holding 4 hashed blocks (8 prompt tokens and
    # 8 generated ones); a's growth then evicts b's tail blocks b3 and b2; b comes back when a is done
    assert b.preemptions == 1 and sum(len(p.preempted) for p in plans) == 1
    assert b.cached_tokens == 8
    assert s.preempted_prefix_hits == 8 and s.preempted_prefix_queries == 17
    assert (s.prefix_queries, s.prefix_hits) == (16, 0)  # vLLM's counters leave preempted requests out
    assert s.free_blocks == 9


def test_virtual_time_segments_share_leading_blocks_and_prefill_only_the_rest() -> None:
    p = PROFILES["8b-h100"]
    sys_prompt = [("system-prompt", 1000)]
    a = Request("a", 1200, 5, 0.0, content=Prompt.from_segments(sys_prompt))
    b = Request("b", 1200, 5, 10.0, content=Prompt.from_segments(sys_prompt))
    c = Request("c", 1200, 5, 20.0, content=Prompt.from_segments([("another", 1000)]))
    simulate(Engine(p), [a, b, c])
    # 1000 shared tokens = 62 full blocks of 16 (992 tokens); block 62 mixes them with b's own tokens
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 992, 0)
    assert a.first_token == pytest.approx(p.step_ms(1200, 0, 1200) / 1000)
    assert b.first_token - b.arrival == pytest.approx(p.step_ms(1200 - 992, 0, 1200) / 1000)  # type: ignore[operator]
    off = [Request(r.id, 1200, 5, r.arrival, content=r.content) for r in (a, b)]
    simulate(Engine(p, EngineOptions(prefix_caching=False)), off)
    assert off[1].cached_tokens == 0 and off[1].first_token - off[1].arrival > b.first_token - b.arrival  # type: ignore[operator]


def test_prompt_content_from_text_counts_as_the_server_does() -> None:
    assert Prompt.from_text("x" * 10).length == 3 and Prompt.from_text("").length == 1
    chat = Prompt.from_chat([("system", "s" * 30), ("user", "u" * 9)])
    assert chat.length == 4 * 2 + -(-39 // 4)
    # the same leading message, a different question: the same leading tokens, as far as the system part
    other = Prompt.from_chat([("system", "s" * 30), ("user", "v" * 9)])
    key_a, key_b = chat.block_key(0, 8, 100, 1), other.block_key(0, 8, 100, 2)
    assert key_a == key_b and chat.block_key(8, 16, 100, 1) != other.block_key(8, 16, 100, 2)
    with pytest.raises(ValueError):
        Prompt()


@settings(max_examples=40, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.lists(st.sampled_from("abc"), max_size=3), st.integers(0, 30), st.integers(1, 20),
                            st.integers(0, 6)), min_size=1, max_size=25),
    blocks=st.integers(20, 60), budget=st.integers(4, 64),
)
def test_reference_counts_and_the_free_queue_stay_consistent(
        reqs: list[tuple[list[str], int, int, int]], blocks: int, budget: int) -> None:
    s = sched(blocks=blocks, budget=budget)
    arrivals = []
    for i, (segs, own, out, at) in enumerate(reqs):
        prompt = [(seg, 5) for seg in segs]
        n = max(1, min(len(segs) * 5 + own, blocks * 4 - out - 8))
        arrivals.append(Request(str(i), n, out, float(at), content=Prompt.from_segments(prompt)))
    pending = sorted(arrivals, key=lambda r: r.arrival)
    t = 0.0
    while pending or s.has_work():
        while pending and pending[0].arrival <= t:
            s.add(pending.pop(0))
        plan = s.schedule(t)
        s.finish_step(plan, t + 1)
        t += 1
        holders: dict[Block, int] = {}
        blank = 0
        for r in s.running:
            blank += r.blocks - len(r.hashed)
            for b in r.hashed:
                holders[b] = holders.get(b, 0) + 1
        assert all(b.ref == n for b, n in holders.items())  # a block's references are its holders
        assert all(b in s._cached[b.hash] for b in holders)  # a block in use is never evicted
        assert s.free_blocks == blocks - blank - len(holders)
        queue = list(s._queue)
        if queue:
            assert sum(e.n for e in queue if isinstance(e, BlankRun)) + s.evictable_blocks == s.free_blocks
            assert all(e.ref == 0 for e in queue if isinstance(e, Block))
        assert t < 10_000
    assert all(r.status is Status.FINISHED for r in arrivals)
    assert s.free_blocks == blocks and s.prefix_hits <= s.prefix_queries


class Sim:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "sim", "--port", str(self.port), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)
        self.url = f"http://127.0.0.1:{self.port}"

    def chat(self, content: str) -> dict[str, object]:
        code, _, body = post(self.url + "/v1/chat/completions", {
            "messages": [{"role": "system", "content": "You are helpful. " * 20},
                         {"role": "user", "content": content}], "max_tokens": 3, "ignore_eos": True})
        assert code == 200
        doc: dict[str, object] = json.loads(body)
        return doc

    def metrics(self) -> str:
        return get(self.url + "/metrics")[2].decode()


@pytest.mark.parametrize("args, queries, hits, on", [
    ((), "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "True"),
    (("--legacy-kv-metric",), "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total", "True"),
    (("--no-enable-prefix-caching",), "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "False"),
])
def test_the_http_node_counts_prefix_cache_hits(args: tuple[str, ...], queries: str, hits: str, on: str) -> None:
    sim = Sim(*args)
    try:
        first = sim.chat("What is a KV cache?")
        sim.chat("What is a KV cache?")
        text = sim.metrics()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm:") and "{" in line}
        assert f'enable_prefix_caching="{on}"' in text
        prompt = first["usage"]["prompt_tokens"]  # type: ignore[index]
        if on == "True":
            assert values[queries] == 2 * prompt
            assert 0 < values[hits] < prompt  # the second request: its full blocks but the last token
        else:
            assert values[queries] == 0 and values[hits] == 0
        [reading] = parse(text).values()  # the probe reads either generation of names
        assert reading.counters["prefix_queries"] == values[queries]
        assert reading.counters["prefix_hits"] == values[hits]
    finally:
        sim.proc.terminate()
        sim.proc.wait(10)


def test_the_http_node_rejects_a_bad_cache_salt() -> None:
    sim = Sim()
    try:
        code, _, body = post(sim.url + "/v1/completions", {"prompt": "hi", "cache_salt": 7})
        assert code == 400 and b"cache_salt" in body
        code, _, _ = post(sim.url + "/v1/completions", {"prompt": "hi", "cache_salt": "s", "max_tokens": 1})
        assert code == 200
    finally:
        sim.proc.terminate()
        sim.proc.wait(10)
