"""What made a decision and a probe reading cheap at 1,000 nodes changes no answer (``kvgate bench scale``):
prefix matching of a sample only, the breaker count kept by transitions, the largest KV cache kept between
readings — each against the plain computation it replaced."""

from __future__ import annotations

import random
from typing import Any

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
