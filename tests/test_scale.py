"""What made a decision and a probe reading cheap at 1,000 nodes changes no answer (``kvgate bench scale``):
prefix matching of a sample only, the breaker count kept by transitions, the largest KV cache kept between
readings — each against the plain computation it replaced."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.breaker import State
from ext_proc.config import Nodes
from ext_proc.nodes import SCAN_LIMIT, Fleet, Level
from ext_proc.prefix import PrefixIndex
from gpu_probe.snapshot import Snapshot

NODES = [f"n{i}" for i in range(6)]
chains = st.lists(st.integers(0, 5), min_size=1, max_size=6).map(
    lambda path: tuple(hash(tuple(path[:i + 1])) for i in range(len(path))))  # shared heads, like prompts


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NODES), chains, st.floats(0, 20)), max_size=40), chains,
       st.sets(st.sampled_from(NODES)), st.floats(0, 25))
def test_matching_among_some_nodes_is_the_whole_match_restricted_to_them(
        records: list[tuple[str, tuple[int, ...], float]], chain: tuple[int, ...], among: set[str], now: float) -> None:
    idx = PrefixIndex(max_blocks_per_node=8, ttl_s=10.0)  # small: evictions and expiries happen
    for node, c, at in sorted(records, key=lambda r: r[2]):
        idx.record(node, c, at)
    whole = idx.match(chain, now)
    assert idx.match(chain, now, among) == {n: k for n, k in whole.items() if n in among}


def _fleet(n: int, seed: int) -> Fleet:
    cfg = Nodes.model_validate({"static": [{"address": f"10.0.0.{i}:8000", "probe": f"http://10.0.0.{i}:9102"}
                                           for i in range(n)], "prefix": {"max_blocks_per_node": 64}})
    f = Fleet(cfg, rng=random.Random(seed))
    f.set_levels([Level(0, 0.2), Level(1, 1.0)])
    return f


def _reading(rng: random.Random, address: str, now: float) -> Snapshot:
    return Snapshot(address, now, True, kv_usage=rng.uniform(0.0, 0.99), blocks_total=rng.choice((1000, 2000, 4000)),
                    block_size=rng.choice((16, 32)), running=float(rng.randint(0, 30)),
                    waiting=float(rng.choice((0, 0, 2))), itl_s=rng.uniform(0.01, 0.2), step_fresh=True,
                    step_tokens=rng.uniform(50, 500), step_decode=rng.uniform(5, 40))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_large_fleet_chooses_as_it_did_when_every_holder_was_matched(seed: int) -> None:
    """Two fleets, one matching prefixes over every node (as before), fed the same readings and
    requests: every choice is the same node, with the same prediction and hit."""
    n = SCAN_LIMIT + 20
    new, old = _fleet(n, seed), _fleet(n, seed)
    old.hits = lambda prefix, prompt_tokens, now, among=None: Fleet.hits(old, prefix, prompt_tokens, now)  # type: ignore[method-assign]
    rng = random.Random(seed)
    heads = [tuple(rng.getrandbits(60) for _ in range(rng.randint(1, 6))) for _ in range(5)]
    for i in range(300):
        now = i * 0.05
        if i % 20 == 0:
            for addr in list(new.nodes):
                r = rng.random()
                for f in (new, old):
                    f.on_snapshot(addr, _reading(random.Random(r), addr, now), now)
        head = rng.choice(heads)
        chain = head + tuple(rng.getrandbits(60) for _ in range(rng.randint(0, 3)))
        prompt = rng.choice((200, 1500, 6000))
        args: dict[str, Any] = {"priority": i % 2, "target": rng.choice((0.2, 1.0, None)), "limit": 5.0,
                                "prefix": chain}
        a = new.place(prompt + 100, prompt, f"t{i}", now, **args)
        b = old.place(prompt + 100, prompt, f"t{i}", now, **args)
        assert (a.node and a.node.address, a.reason, a.ttft, a.hit) == (b.node and b.node.address, b.reason, b.ttft,
                                                                          b.hit), i
        if a.node is not None and rng.random() < 0.7:
            for f in (new, old):
                f.completed(a.node.address, f"t{i}", prompt + 100, True, now)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["go", "read", "nodes"]), st.integers(0, 9),
                          st.sampled_from(list(State)), st.integers(1, 10)), max_size=40))
def test_the_kept_breaker_count_and_largest_cache_are_what_counting_gives(
        ops: list[tuple[str, int, State, int]]) -> None:
    f = _fleet(10, 1)
    rng = random.Random(2)
    for i, (op, k, state, size) in enumerate(ops):
        addrs = list(f.nodes)
        if op == "go" and addrs:
            f.nodes[addrs[k % len(addrs)]].breaker._go(state, "test", float(i))
        elif op == "read" and addrs:
            f.on_snapshot(addrs[k % len(addrs)], _reading(rng, "x", float(i)), float(i))
        elif op == "nodes":
            f.set_nodes([(f"10.0.0.{j}:8000", f"http://10.0.0.{j}:9102", None) for j in range(size)])
        not_closed = sum(1 for n in f.nodes.values() if n.breaker.state is not State.CLOSED)
        total = len(f.nodes)
        assert f._may_open_another() == (not_closed + 1 < total
                                         and not_closed + 1 <= f.cfg.breaker.max_open_fraction * total)
        caps = [c for n in f.nodes.values() if (c := n.capacity_tokens()) is not None]
        assert f.max_capacity_tokens() == (max(caps) if caps else None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NODES), chains, st.floats(0, 20)), max_size=40), chains,
       st.floats(0, 25), st.integers(1, 8))
def test_the_deepest_holders_are_the_nodes_whose_match_is_longest(
        records: list[tuple[str, tuple[int, ...], float]], chain: tuple[int, ...], now: float, limit: int) -> None:
    """``deepest`` bisects on "does any node hold this block" instead of matching every holder: it names
    the nodes ``match`` gives the longest run (as many as ``limit`` allows), none when nobody holds the
    first block."""
    idx = PrefixIndex(max_blocks_per_node=8, ttl_s=10.0)
    for node, c, at in sorted(records, key=lambda r: r[2]):
        idx.record(node, c, at)
    whole = idx.match(chain, now)
    longest = max(whole.values(), default=0)
    best = {n for n, k in whole.items() if k == longest and k > 0}
    got = idx.deepest(chain, now, limit)
    assert len(got) == len(set(got)) == min(limit, len(best))
    assert set(got) <= best


def _loaded(n: int, seed: int, kv: float = 0.1, room: str | None = None) -> Fleet:
    """Every node read at ``kv`` occupancy, but ``room`` at 0.1."""
    f = _fleet(n, seed)
    for addr in f.nodes:
        f.on_snapshot(addr, Snapshot(addr, 0.0, True, kv_usage=0.1 if addr == room else kv, blocks_total=2000,
                                     block_size=16), 0.0)
    return f


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(SCAN_LIMIT + 1, 300))
def test_a_large_fleet_finds_the_one_node_with_room_however_far_down_its_scan(seed: int, n: int) -> None:
    """A large fleet filters only until enough nodes pass, but when nearly every node is full it looks
    at the whole fleet before answering 503: the one node with room is found, wherever the scan starts."""
    room = f"10.0.0.{random.Random(seed).randrange(n)}:8000"
    f = _loaded(n, seed, kv=0.99, room=room)
    for i in range(5):
        c = f.place(600, 500, f"t{i}", 0.01 * i, priority=1)
        assert c.node is not None and c.node.address == room, c.reason
    for addr in f.nodes:
        f.on_snapshot(addr, Snapshot(addr, 0.1, True, kv_usage=0.99, blocks_total=2000, block_size=16), 0.1)
    assert f.place(600, 500, "full", 0.1, priority=1).reason == "fleet-kv"


def test_a_large_fleet_sends_a_prompt_back_to_the_node_holding_its_prefix() -> None:
    """At 1,000 nodes the random part of a scan rarely reaches a given node: the holders of the
    prompt's longest held prefix are looked at first, so an idle fleet keeps each document on its node."""
    f = _loaded(1000, 7)
    rng = random.Random(7)
    homes: dict[int, str] = {}
    docs = [tuple(rng.getrandbits(60) for _ in range(12)) for _ in range(20)]
    for i in range(200):
        now = 0.001 * i
        k = i % len(docs)
        chain = docs[k] + (rng.getrandbits(60),)  # the document, then a question of its own
        c = f.place(1800, 1700, f"t{i}", now, prefix=chain)
        assert c.node is not None
        if k in homes:
            assert c.node.address == homes[k] and c.hit > 0, i
        else:
            homes[k] = c.node.address
        f.completed(c.node.address, f"t{i}", 1800, True, now)
    assert len(set(homes.values())) > 1, "documents spread over the fleet, not all on one node"


def _full_reading(rng: random.Random, address: str, now: float) -> Snapshot:
    """Mostly a fleet near or past its admit threshold (0.92), some breakers tripping on KV (0.95)."""
    kv = rng.uniform(0.85, 0.97) if rng.random() < 0.85 else rng.choice((rng.uniform(0.0, 0.3), None))
    return Snapshot(address, now, True, kv_usage=kv, blocks_total=rng.choice((1000, 4000, 4000, 4000, None)),
                    block_size=16, running=float(rng.randint(0, 3)),
                    waiting=float(rng.choice((0, 0, 1))), itl_s=rng.uniform(0.01, 0.2), step_fresh=True,
                    step_tokens=rng.uniform(50, 500), step_decode=rng.uniform(5, 40))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([4, SCAN_LIMIT + 8]))
def test_a_fleet_that_asks_its_room_first_chooses_as_one_that_filters_every_node(seed: int, size: int) -> None:
    """``Fleet.room`` answers "no node can take it" without filtering the fleet: two fleets, one whose
    room always says "might" (every choice filters every node, as before), fed the same readings (full
    nodes, empty ones, nodes without a KV reading, the whole fleet full), requests (three sizes, three
    reserves), completions (ok, failed, no verdict), breaker transitions, silences long enough to go
    dead and a changing node set: every answer is the same — node, reason, Retry-After, prediction —
    and each node's room is what judging it afresh gives."""
    new, old = _fleet(size, seed), _fleet(size, seed)
    old.room.might_fit = lambda reserve, now, tokens=0: True  # type: ignore[method-assign]
    rng = random.Random(seed)
    sent: list[tuple[str, str]] = []
    now, said_no = 0.0, 0

    def fill(now: float) -> None:  # the whole fleet full at once
        for a in list(new.nodes):
            snap = Snapshot(a, now, True, kv_usage=rng.uniform(0.92, 0.949), blocks_total=4000, block_size=16,
                            running=2.0, waiting=0.0)
            for f in (new, old):
                f.on_snapshot(a, snap, now)

    def ask(i: int, now: float, reserve: float, prompt: int, target: float | None) -> int:
        """One request to both fleets: the same answer from each; 1 where the room said no by itself."""
        no = not new.room.might_fit(reserve, now, prompt + 100)
        args: dict[str, Any] = {"reserve": reserve, "priority": i % 2, "target": target, "limit": 5.0}
        a_, b_ = new.place(prompt + 100, prompt, f"t{i}", now, **args), old.place(prompt + 100, prompt, f"t{i}",
                                                                                    now, **args)
        assert (a_.node and a_.node.address, a_.reason, a_.retry_after, a_.ttft) == (
            b_.node and b_.node.address, b_.reason, b_.retry_after, b_.ttft), i
        if a_.node is not None:
            sent.append((a_.node.address, f"t{i}"))
        return int(no)

    for i in range(250):
        now += rng.choice((0.01, 0.1, 0.5, 4.0))  # (dead_after_seconds is 10 by default)
        addrs = list(new.nodes)
        op = rng.random()
        if op < 0.35:
            a, r = rng.choice(addrs), rng.random()
            for f in (new, old):
                f.on_snapshot(a, _full_reading(random.Random(r), a, now), now)
        elif op < 0.4 and sent:
            a, t = sent.pop(rng.randrange(len(sent)))
            ok = rng.choice((True, False, None))
            for f in (new, old):
                f.completed(a, t, 100, ok, now)
        elif op < 0.43:
            a, state = rng.choice(addrs), rng.choice(list(State))
            for f in (new, old):
                f.nodes[a].breaker._go(state, "test", now)
        elif op < 0.47:
            fill(now)
        elif op < 0.49:
            keep = rng.sample(range(size), rng.randint(1, size))
            for f in (new, old):
                f.set_nodes([(f"10.0.0.{j}:8000", f"http://10.0.0.{j}:9102", None) for j in sorted(keep)])
        else:
            reserve = rng.choice((0.0, 0.05, 0.1))
            prompt = rng.choice((50, 400, 3000))
            said_no += ask(i, now, reserve, prompt, rng.choice((0.2, 1.0, None)))
        room = new.room
        for n in new.nodes.values():
            kept = room._rooms[id(n)]
            # what judging it afresh gives — or none, for a node node choice found dead (and still is)
            assert kept == room._judge(n) or (max(kept, default=0) == -math.inf and new.status(n, now) == "dead"), i
    # and once the whole fleet is full, a request asks it: the room answers for itself on every seed (a run
    # that drew no such moment — seed 209 at 40 nodes — left the comparison above untested for it)
    now += 0.01
    fill(now)
    said_no += ask(-1, now, 0.0, 400, 1.0)
    assert said_no  # (the room did answer for itself)


@pytest.mark.parametrize("trials_left", [True, False])
def test_a_full_fleet_with_a_half_open_node_answers_without_filtering(trials_left: bool) -> None:
    """A half-open breaker's node is filtered on KV as a closed one's is: in a full fleet its room is what its
    KV leaves, not unbounded, so the room says no by itself (one half-open node had sent every question to
    node choice, which filtered the whole fleet: review103 M5) — with the answer filtering gives, every other
    node open: ``fleet-kv`` while its trial is left (its KV refused it), ``fleet-breakers-open`` once spent."""
    f = _fleet(4, 1)
    now = 100.0
    for i, a in enumerate(f.nodes):
        f.on_snapshot(a, Snapshot(a, now, True, kv_usage=0.95, blocks_total=4000, block_size=16, running=2.0,
                                  waiting=0.0), now)
        f.nodes[a].breaker._go(State.HALF_OPEN if i == 0 else State.OPEN, "test", now)
    half = f.nodes[next(iter(f.nodes))].breaker
    if not trials_left:
        while half.allows(now):
            half.dispatched()
    assert not f.room.might_fit(0.0, now, 500)
    c = f.place(500, 400, "t", now, reserve=0.0, priority=0, target=1.0, limit=5.0)
    assert c.node is None and c.reason == ("fleet-kv" if trials_left else "fleet-breakers-open")


def test_with_requests_waiting_a_full_fleets_reading_filters_no_node() -> None:
    """The gateway queue asks node choice for its heads at every event. With every node full that used
    to filter the whole fleet per tier for each probe reading (2.3 ms at 1,000 nodes); now the room says
    no first. Counted, not timed: a reading that shows no room runs no filter and computes no
    Retry-After, and the one that shows room still releases the request waiting for it."""
    from ext_proc.config import parse_config
    from ext_proc.core import Core, Held, Request, null_logger
    from ext_proc.identity import hash_key

    addrs = [f"10.0.1.{i}:8000" for i in range(SCAN_LIMIT + 8)]
    t = [100.0]
    core = Core(parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("sk-room")]}],
                              "nodes": {"static": [{"address": a, "probe": "http://p.invalid"} for a in addrs]}}),
                lambda: t[0], rng=random.Random(1), log=null_logger())

    def reading(a: str, kv: float) -> Snapshot:
        return Snapshot(a, t[0], True, kv_usage=kv, blocks_total=1000, block_size=16, running=4.0, waiting=0.0)

    for a in addrs:
        core.snapshot(a, reading(a, 0.93))
    held = core.decide(Request(path="/v1/completions", request_id="r1", authorization="Bearer sk-room",
                               body=b'{"model": "m", "prompt": "hi", "max_tokens": 5}'))
    assert isinstance(held, Held)
    fleet = core.fleet
    assert fleet is not None
    filtered: list[int] = []
    plain = fleet._choose

    def counted(*args: Any, **kw: Any) -> Any:
        filtered.append(1)
        return plain(*args, **kw)

    fleet._choose = counted  # type: ignore[method-assign]
    walked: list[int] = []
    retry_after = fleet._retry_after
    fleet._retry_after = lambda *args: walked.append(1) or retry_after(*args)  # type: ignore[method-assign]
    for a in addrs:
        t[0] += 0.001
        core.snapshot(a, reading(a, 0.94))
    # (nor a Retry-After, another walk over the fleet, for an answer the queue only reads "not yet" from)
    assert core.queued == 1 and filtered == [] and walked == []
    t[0] += 0.001
    core.snapshot(addrs[7], reading(addrs[7], 0.2))
    assert filtered and core.queued == 0
    (answer,) = core.answers()
    assert answer.decision.admitted and answer.decision.lease is not None
    assert answer.decision.lease.node == addrs[7]


def test_the_bench_with_requests_waiting_keeps_the_fleet_full_and_the_queue_full() -> None:
    """``kvgate bench scale``'s figure with requests waiting measures what it says: no request goes (every
    node is full) and the gateway queue holds as many as asked all along. (Figures are printed, not
    asserted.)"""
    from kvgate.bench.scale import waiting_queue

    row = waiting_queue(SCAN_LIMIT + 8, waiting=5, ops=300, quiet=True)
    assert row["queued_mean"] == 5
    assert row["reading_p50_us"] > 0 and row["decide_p99_us"] >= row["decide_p50_us"]


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(SCAN_LIMIT + 1, 300))
def test_a_forced_choice_in_a_large_fleet_scores_a_few_nodes_and_still_finds_the_one_alive(
        seed: int, n: int) -> None:
    """(review) A shadow decision or a bodyless request (any live node) scored every node: 392 µs at
    1,000 nodes. A large fleet now scores MAX_CANDIDATES live ones in scan order — and, with every other
    node dead, still walks the ring to the one alive."""
    from ext_proc.nodes import MAX_CANDIDATES

    f = _loaded(n, seed)
    scored: list[str] = []
    score = f._score
    f._score = lambda node, tokens: (scored.append(node.address), score(node, tokens))[1]  # type: ignore[method-assign]
    c = f.choose(0, 1.0, force=True)
    assert c.node is not None and len(scored) == MAX_CANDIDATES
    alive = f"10.0.0.{random.Random(seed).randrange(n)}:8000"
    later = 100.0  # every node dead (no reading since 0) but one
    f.on_snapshot(alive, Snapshot(alive, later, True, kv_usage=0.5, blocks_total=2000, block_size=16), later)
    c = f.choose(0, later, force=True)
    assert c.node is not None and c.node.address == alive
    f.on_snapshot(alive, Snapshot(alive, later, True, kv_usage=0.5, blocks_total=2000, block_size=16), later)
    assert f.choose(0, later + 100.0, force=True).reason == "fleet-no-healthy-node"
