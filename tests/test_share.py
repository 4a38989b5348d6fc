"""The arithmetic of slices (``ext_proc/share.py``): property tests, no I/O.

The same water-filling runs in Redis; ``test_store.py`` checks the script against these functions.
"""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from ext_proc.config import parse_config
from ext_proc.core import Core
from ext_proc.nodes import Fleet
from ext_proc.share import even_slots, fair_slots, fallback_slots, waterfill, with_expected
from gpu_probe.snapshot import Snapshot

names = st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=1, max_size=6, unique=True)


@given(demands=st.dictionaries(st.text("abcdef", min_size=1, max_size=3), st.integers(0, 50), min_size=1,
                               max_size=6),
       cap=st.integers(0, 100), data=st.data())
def test_fair_slots_are_max_min_fair_spares_last_and_never_exceed_the_capacity(
        demands: dict[str, int], cap: int, data: st.DataObject) -> None:
    spares = set(data.draw(st.lists(st.sampled_from(sorted(demands)), unique=True)))
    got = fair_slots(demands, cap, spares)
    assert sum(got.values()) <= cap
    assert all(0 <= got[k] <= demands[k] + (k in spares) for k in demands)
    if sum(demands.values()) <= cap:
        assert all(got[k] >= demands[k] for k in demands), "everyone gets what it needs when there is enough"
        assert sum(got.values()) == min(cap, sum(demands.values()) + len(spares)), "then a spare each"
    else:
        assert all(got[k] <= demands[k] for k in demands), "no spare while someone's demand is unmet"
        assert sum(got.values()) == cap, "nothing is left idle while someone needs more"
        for k in demands:  # max-min: nobody short of its demand has less than another's share minus one
            if got[k] < demands[k]:
                assert all(got[k] >= got[j] - 1 for j in demands)
    assert sum(waterfill(demands, cap).values()) <= cap + 1e-9


hex_ids = st.lists(st.text("0123456789abcdef", min_size=8, max_size=8), min_size=1, max_size=5, unique=True)


@given(fleet=hex_ids, dead=st.lists(st.text("0123456789abcdef", min_size=8, max_size=8), max_size=2),
       more=st.integers(0, 3), cap=st.integers(0, 30), data=st.data())
def test_a_fallback_split_never_admits_more_than_the_cap_whatever_each_replica_saw(
        fleet: list[str], dead: list[str], more: int, cap: int, data: st.DataObject) -> None:
    """Issue 29 bug 2. Each replica splits on its own view: the replicas the store last listed (every
    replica read the same list, which may still name dead ones), or only itself when the store never
    answered it; padded to ``expected_replicas`` (at least the replicas running). Whatever the mix, the
    slots all replicas admit on add up to at most the cap: with Redis unreachable from the start, 3
    replicas turned a cap of 4 into 6 and a cap of 1 into 3."""
    expected = len(fleet) + more
    listed = sorted(set(fleet) | set(dead))
    views = data.draw(st.lists(st.booleans(), min_size=len(fleet), max_size=len(fleet)))
    total = 0
    for me, saw_the_store in zip(fleet, views, strict=True):
        live = with_expected(listed if saw_the_store else [me], expected)
        total += fallback_slots(cap, {}, live)[me]
    assert total <= cap
    if not any(views):  # nobody ever heard from the store: nobody takes more than an even floor
        assert total == len(fleet) * (cap // expected)


def test_with_redis_unreachable_from_the_start_three_replicas_keep_caps_four_and_one() -> None:
    fleet = ["0a1b2c3d", "5e6f7a8b", "c9d0e1f2"]
    for cap, want in ((4, 3), (1, 0), (6, 6)):
        assert sum(fallback_slots(cap, {}, with_expected([me], 3))[me] for me in fleet) == want


@given(replicas=names, cap=st.integers(0, 40), data=st.data())
def test_a_fallback_split_keeps_the_total_within_the_cap_while_holdings_drain(
        replicas: list[str], cap: int, data: st.DataObject) -> None:
    # holdings as the store last recorded them: a valid partition of the cap
    held: dict[str, int] = {}
    left = cap
    for r in replicas:
        held[r] = data.draw(st.integers(0, left))
        left -= held[r]
    slots = fallback_slots(cap, held, replicas)
    assert set(slots) == set(replicas)
    # each replica keeps what it held until it drains and admits up to its slots: the worst case
    assert sum(max(held[r], slots[r]) for r in replicas) <= cap
    assert sum(even_slots(cap, replicas).values()) == cap
    if all(held[r] <= even_slots(cap, replicas)[r] for r in replicas):
        assert slots == even_slots(cap, replicas), "an even split when nobody held more than its share"


def test_other_replicas_service_counts_in_the_fair_share_counters_and_their_requests_on_the_nodes() -> None:
    cfg = parse_config({"tenants": [{"name": "a"}, {"name": "b"}],
                        "nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://10.0.0.1:9102"}]}})
    core = Core(cfg, time.monotonic)
    q = core.admission.queue
    before = q.counter("a")
    core.remote({"a": 1000.0, "nobody": 5.0, "b": float("nan")}, [])
    assert q.counter("a") == before + 1000.0
    assert q.counter("nobody") == 0.0 and q.counter("b") == 0.0
    fleet = core.fleet
    assert isinstance(fleet, Fleet)
    snap = Snapshot(node="n0", at=time.time(), ok=True, kv_usage=0.1, blocks_total=1000, block_size=16, running=1,
                    waiting=0)
    fleet.on_snapshot("10.0.0.1:8000", snap, time.monotonic())
    node = fleet.nodes["10.0.0.1:8000"]
    kv = node.projected_kv()
    core.remote({}, [("10.0.0.1:8000", 4000, 3000, "standard"), ("10.9.9.9:1", 10, 10, "standard")])
    assert node.pending_tokens == 4000, "another replica's request is booked until a reading shows it"
    assert node.projected_kv() is not None and kv is not None and node.projected_kv() > kv
