import random
from collections import Counter

from ext_proc.breaker import State
from ext_proc.config import parse_config
from ext_proc.nodes import Fleet
from gpu_probe.snapshot import Snapshot


def fleet(n: int = 2, **nodes: object) -> Fleet:
    cfg = parse_config({"nodes": {"static": [{"address": f"10.0.0.{i}:8000", "probe": f"http://p{i}"}
                                             for i in range(n)], **nodes}})
    assert cfg.nodes is not None
    return Fleet(cfg.nodes, random.Random(3))


def snap(kv: float, blocks: int = 1000, waiting: float = 0, prefill: float | None = 0.1) -> Snapshot:
    return Snapshot(node="n", at=0, ok=True, kv_usage=kv, blocks_total=blocks, block_size=16, waiting=waiting,
                    prefill_s=prefill, prefill_s_per_ktok=prefill)


def stepping(f: Fleet, kv: float, ratio: float, decode: int = 8, prefill: int = 0, blocks: int = 1000,
             fresh: bool = True, at: float = 0.0) -> Snapshot:
    """A reading (taken at ``at``) whose engine steps took ``ratio`` x what the fleet's model predicts
    for the batch they ran: ``decode`` sequences plus ``prefill`` tokens per step, beside the KV cache's
    context."""
    context = kv * blocks * 16
    itl = ratio * f.model.step(prefill, decode, context)
    return Snapshot(node="n", at=at, ok=True, kv_usage=kv, blocks_total=blocks, block_size=16, running=decode,
                    itl_s=itl, step_fresh=fresh, step_tokens=float(prefill + decode), step_decode=float(decode))


def busy(f: Fleet, at: float) -> Snapshot:
    """A healthy node running a big mixed batch on a big KV cache: steps ~5x an idle node's, all of it load."""
    return stepping(f, 0.8, 1.0, decode=400, prefill=600, blocks=20_000, at=at)


def feed(f: Fleet, now: float, *kvs: float) -> None:
    for i, kv in enumerate(kvs):
        f.on_snapshot(f"10.0.0.{i}:8000", snap(kv), now)


def test_node_under_kv_pressure_gets_nothing() -> None:
    f = fleet()
    feed(f, 0, 0.93, 0.2)
    picks = Counter(f.choose(100, 0.1).node.address for _ in range(50))  # type: ignore[union-attr]
    assert picks == {"10.0.0.1:8000": 50}


def test_projected_kv_counts_what_was_sent_since_the_snapshot() -> None:
    f = fleet(1)
    feed(f, 0, 0.5)
    n = f.nodes["10.0.0.0:8000"]
    for _ in range(6):  # 6 x 1000 tokens = 6000 of 16000 tokens of KV
        f.dispatched(n.address, f"t{_}", 1000, 100, 0.1)
    assert n.projected_kv() == 0.5 + 6000 / 16000
    c = f.choose(1000, 0.2)
    assert c.node is None and c.reason == "fleet-kv" and c.retry_after is not None
    f.on_snapshot(n.address, snap(0.5), 0.3)  # a reading taken after those dispatches includes them
    assert n.projected_kv() == 0.5 and f.choose(1000, 0.3).node is n


def test_open_breaker_filters_the_node() -> None:
    f = fleet()
    feed(f, 0, 0.3, 0.3)
    feed(f, 0.1, 0.96, 0.3)  # node 0 trips (kv > 0.95)
    assert f.nodes["10.0.0.0:8000"].breaker.state is State.OPEN
    feed(f, 1, 0.9, 0.3)  # still open: its cache has not drained below close_kv (0.85)
    assert {f.choose(1, 1).node.address for _ in range(20)} == {"10.0.0.1:8000"}  # type: ignore[union-attr]
    f.on_snapshot("10.0.0.1:8000", snap(0.97), 1)
    assert f.nodes["10.0.0.1:8000"].breaker.state is State.CLOSED  # the last closed node stays closed
    c = f.choose(1, 1)
    assert c.node is None and c.reason == "fleet-kv"  # and node choice holds its traffic back
    b = fleet(3, breaker={"max_open_fraction": 1.0})
    feed(b, 0, 0.3, 0.3, 0.3)
    feed(b, 0.1, 0.96, 0.97, 0.3)
    b.nodes["10.0.0.2:8000"].breaker._go(State.OPEN, "test: opened by hand", 0.1)
    c = b.choose(1, 1)
    assert c.node is None and c.reason == "fleet-breakers-open"
    assert 28 < c.retry_after <= 30  # type: ignore[operator]  # until the first recovery window ends


def test_a_node_opened_by_its_full_cache_gets_its_trials_once_the_cache_drained() -> None:
    """Its full cache was its load, not sickness: once a reading shows it below close_kv, node choice sends it
    its half-open trials at once, not a recovery window (30 s) later while its peers refuse work."""
    f = fleet(3)
    feed(f, 0, 0.3, 0.3, 0.3)
    feed(f, 0.1, 0.96, 0.5, 0.5)
    assert f.nodes["10.0.0.0:8000"].breaker.state is State.OPEN
    feed(f, 2, 0.5, 0.9, 0.9)  # drained; its peers are nearly full
    assert f.nodes["10.0.0.0:8000"].breaker.state is State.HALF_OPEN
    c = f.choose(1, 2)
    assert c.node is not None and c.node.address == "10.0.0.0:8000"


def test_only_trials_close_a_half_open_breaker_and_a_drained_cache_says_when_it_will_be_one() -> None:
    """Requests sent to a node before its breaker opened, ending once it is half-open, say nothing of how it
    serves now: they do not close it, its trials do (attack95 F3). While it is open for its full cache alone, the
    Retry-After of a fleet with no room counts the time that cache takes to drain below close_kv, not the whole
    recovery window (review96 #3)."""
    b = fleet(2)
    m = b.nodes["10.0.0.0:8000"]
    feed(b, 0, 0.3, 0.3)
    for i in range(5):
        b.dispatched(m.address, f"old{i}", 1, 1, 0.05)
    feed(b, 0.1, 0.96, 0.3)
    assert m.breaker.state is State.OPEN
    feed(b, 0.2, 0.5, 0.3)
    assert m.breaker.state is State.HALF_OPEN
    for i in range(5):
        b.completed(m.address, f"old{i}", 1, True, 0.3 + i * 0.01)
    assert m.breaker.state is State.HALF_OPEN  # five old successes: not five trials
    for i in range(5):
        b.dispatched(m.address, f"trial{i}", 1, 1, 0.4)
    for i in range(5):
        b.completed(m.address, f"trial{i}", 1, True, 0.5 + i * 0.01)
    assert m.breaker.state is State.CLOSED

    d = fleet(2)
    feed(d, 0, 0.3, 0.3)
    feed(d, 0.1, 0.96, 0.97)  # the second stays closed (the last), but full: nothing has room
    o = d.nodes["10.0.0.0:8000"]
    assert o.breaker.state is State.OPEN and o.breaker.drains
    o.drain_tokens_per_s = 1000.0  # 16,000 tokens of KV: 0.96 -> 0.85 is 1,760 tokens, 1.76 s
    c = d.choose(1, 0.2)
    assert c.node is None and c.retry_after is not None and c.retry_after < 5
    stale = d.cfg.stale_after_seconds + 0.5  # a stale reading promises nothing: the window (review97 #7)
    c = d.choose(1, stale)
    assert c.node is None and c.retry_after is not None and c.retry_after > 20


def test_stale_nodes_are_a_fallback_and_dead_ones_get_nothing() -> None:
    f = fleet(stale_after_seconds=2, dead_after_seconds=10)
    feed(f, 0, 0.1, 0.1)
    f.on_snapshot("10.0.0.1:8000", snap(0.1), 5)  # node 0's probe went quiet after t=0
    assert f.status(f.nodes["10.0.0.0:8000"], 5) == "unknown"
    assert {f.choose(1, 5).node.address for _ in range(20)} == {"10.0.0.1:8000"}  # type: ignore[union-attr]
    f.on_snapshot("10.0.0.1:8000", snap(0.95), 5)  # the fresh node is full: the stale one is the fallback
    assert f.choose(1, 5).node.address == "10.0.0.0:8000"  # type: ignore[union-attr]
    assert f.status(f.nodes["10.0.0.0:8000"], 11) == "dead"
    assert f.choose(1, 11).node is None


def test_avoid_policy_never_uses_stale_nodes() -> None:
    f = fleet(1, unknown="avoid")
    feed(f, 0, 0.1)
    assert f.choose(1, 3).node is None


def test_equal_nodes_share_the_load_instead_of_herding() -> None:
    f = fleet(4)
    feed(f, 0, 0.3, 0.3, 0.3, 0.3)
    picks = Counter()
    for _ in range(400):
        n = f.choose(10, 0.1).node
        assert n is not None
        f.dispatched(n.address, f"t{_}", 10, 5, 0.1)
        picks[n.address] += 1
    assert len(picks) == 4 and min(picks.values()) > 60


def test_half_open_trials_then_close() -> None:
    f = fleet(2, breaker={"recovery_window_seconds": 1, "half_open_requests": 2})
    n = f.nodes["10.0.0.0:8000"]
    for t in range(3):
        feed(f, t, 0.3, 0.93)  # node 1 is too full for new requests, not full enough to trip
    f.on_snapshot(n.address, snap(0.99), 3)
    assert n.breaker.state is State.OPEN and f.choose(1, 3.5).node is None
    feed(f, 4.1, 0.3, 0.93)
    assert n.breaker.state is State.HALF_OPEN
    for i in range(2):
        c = f.place(1, 1, f"t{i}", 4.2)
        assert c.node is n
    assert f.choose(1, 4.2).node is None  # trial budget spent
    f.completed(n.address, "t0", 1, True, 4.5)
    f.completed(n.address, "t1", 1, True, 4.6)
    assert n.breaker.state is State.CLOSED


async def test_dns_discovery_turns_a_name_into_nodes() -> None:
    import asyncio
    import contextlib

    from ext_proc.server import Gateway, discover_nodes

    cfg = parse_config({"nodes": {"dns": {"name": "localhost", "port": 8123, "probe_port": 9123,
                                          "refresh_seconds": 0.1}}})
    gw = Gateway(cfg)
    task = asyncio.create_task(discover_nodes(gw))
    try:
        for _ in range(50):
            if gw.fleet is not None and gw.fleet.nodes:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert gw.fleet is not None
    assert "127.0.0.1:8123" in gw.fleet.nodes
    assert gw.fleet.nodes["127.0.0.1:8123"].probe == "http://127.0.0.1:9123"


def test_a_reload_moves_nodes_that_follow_the_default_threshold_but_not_overrides() -> None:
    f = fleet(2)
    f.nodes["10.0.0.1:8000"].override = 0.7  # as if configured per node
    f.set_nodes([(n.address, n.probe, n.override) for n in f.nodes.values()])
    cfg = parse_config({"nodes": {"dns": {"name": "vllm.example"}, "kv_admit_threshold": 0.6}})
    assert cfg.nodes is not None
    f.reconfigure(cfg.nodes)  # no static list: the (discovered) nodes are kept
    assert f.nodes["10.0.0.0:8000"].threshold == 0.6
    assert f.nodes["10.0.0.1:8000"].threshold == 0.7


def test_a_node_with_a_queue_of_its_own_gets_no_more_until_it_shrinks() -> None:
    f = fleet(1, max_waiting_requests=3, max_prefill_tokens=None)
    n = f.nodes["10.0.0.0:8000"]
    f.on_snapshot(n.address, snap(0.2, waiting=0), 0)
    for i in range(10):  # no queue in vLLM and KV room: it starts what it gets, so no cap applies
        assert f.place(10, 5, f"a{i}", 0.1).node is n
    f.on_snapshot(n.address, snap(0.2, waiting=2), 0.2)
    assert f.place(10, 5, "b0", 0.3).node is n  # 2 waiting + 1 sent since = 3: the cap
    c = f.choose(10, 0.3)
    assert c.node is None and c.reason == "fleet-queue"
    f.on_snapshot(n.address, snap(0.2, waiting=0), 0.4)
    assert f.choose(10, 0.4).node is n


def test_prefill_tokens_in_flight_are_capped_but_a_big_prompt_still_goes_to_an_idle_node() -> None:
    f = fleet(1, max_waiting_requests=None, max_prefill_tokens=8000)
    n = f.nodes["10.0.0.0:8000"]
    f.on_snapshot(n.address, snap(0.1), 0)
    assert f.place(6000, 5000, "a", 0.1).node is n
    assert f.choose(4000, 0.1, prompt_tokens=4000).node is None  # 5000 + 4000 > 8000
    assert f.place(2000, 2000, "b", 0.1).node is n  # 7000 fits
    f.completed(n.address, "a", 6000, True, 0.2)
    f.completed(n.address, "b", 2000, True, 0.2)
    f.on_snapshot(n.address, snap(0.1), 0.3)  # prefilled and gone
    assert n.prefill_tokens() == 0
    assert f.choose(12000, 0.3, prompt_tokens=12000).node is n  # alone it may exceed the cap


def test_a_lower_tier_leaves_kv_headroom_for_a_higher_one() -> None:
    f = fleet(1)  # threshold 0.92
    feed(f, 0, 0.89)
    assert f.choose(10, 0.1, reserve=0.05).node is None  # standard stops at 0.87
    assert f.choose(10, 0.1, reserve=0.0).node is not None  # interactive may use the rest


def test_latency_opens_at_most_the_allowed_share_of_breakers_and_never_the_last() -> None:
    def slow_fleet(n: int, sick: int, **breaker: float) -> Fleet:
        f = fleet(n, breaker=breaker) if breaker else fleet(n)
        for t in range(6):  # learn a baseline: steps as long as the model says, small batches
            for i in range(n):
                f.on_snapshot(f"10.0.0.{i}:8000", stepping(f, 0.3, 1.0, at=t), t)
        for t in range(7, 11):  # then the first `sick` nodes' steps get 10x slower than their model; the
            for i in range(n):  # others run big mixed batches (steps ~5x longer, as the model predicts)
                snap_i = stepping(f, 0.3, 10.0, at=t) if i < sick else busy(f, t)
                f.on_snapshot(f"10.0.0.{i}:8000", snap_i, t)
        return f

    one = slow_fleet(1, 1)
    assert one.nodes["10.0.0.0:8000"].breaker.state is State.CLOSED  # the only node stays in service
    four = slow_fleet(4, 2)
    states = Counter(n.breaker.state for n in four.nodes.values())
    assert states == {State.OPEN: 2, State.CLOSED: 2}  # the two sick ones
    assert all(four.nodes[f"10.0.0.{i}:8000"].breaker.state is State.CLOSED for i in (2, 3))
    capped = slow_fleet(6, 3, max_open_fraction=0.34)
    assert Counter(n.breaker.state for n in capped.nodes.values())[State.OPEN] == 2  # 0.34 x 6
    loaded = slow_fleet(4, 0)  # every node busy together: load, nothing opens
    assert all(n.breaker.state is State.CLOSED for n in loaded.nodes.values())
    rising = fleet(3)
    for t in range(6):
        for i in range(3):
            rising.on_snapshot(f"10.0.0.{i}:8000", stepping(rising, 0.3, 1.0, blocks=20_000, at=t), t)
    for t in range(7, 12):  # batches and KV growing every reading: raw step time ~4x by the end, its model's too
        for i in range(3):
            k = 1.6 ** (t - 6)
            rising.on_snapshot(f"10.0.0.{i}:8000", stepping(rising, min(0.8, 0.3 + 0.1 * (t - 6)), 1.0,
                                                            decode=round(40 * k), prefill=round(60 * k),
                                                            blocks=20_000, at=t), t)
    assert all(n.breaker.state is State.CLOSED for n in rising.nodes.values())
    f = fleet(2)
    f.on_snapshot("10.0.0.1:8000", snap(0.3), 0)
    f.on_snapshot("10.0.0.0:8000", snap(0.99), 0)
    assert f.nodes["10.0.0.0:8000"].breaker.state is State.OPEN  # a full KV cache trips without a cap...
    f.on_snapshot("10.0.0.1:8000", snap(0.99), 0)
    assert f.nodes["10.0.0.1:8000"].breaker.state is State.CLOSED  # ...but never the last closed node


def test_the_last_node_with_a_full_kv_cache_is_held_by_node_choice_not_opened() -> None:
    """Opening the only node on KV would refuse everything for a whole recovery window after its KV
    drained (seen: 27 of 195 interactive requests timed out in the noisy-neighbour test)."""
    f = fleet(1)
    n = f.nodes["10.0.0.0:8000"]
    f.on_snapshot(n.address, snap(0.97), 0)
    assert n.breaker.state is State.CLOSED
    c = f.choose(100, 0.1)
    assert c.node is None and c.reason == "fleet-kv"  # nothing new goes to it while it is full
    f.on_snapshot(n.address, snap(0.5), 0.5)
    assert f.choose(100, 0.6).node is n  # and it is back as soon as its KV drains


def test_requests_waiting_in_vllm_count_in_the_projection_though_they_hold_no_kv_yet() -> None:
    f = fleet(1, max_waiting_requests=None)
    n = f.nodes["10.0.0.0:8000"]
    f.on_snapshot(n.address, snap(0.2), 0)
    for i in range(4):  # 4 x 2000 tokens, 1500 of them prompt
        f.place(2000, 1500, f"r{i}", 0.1)
    # vLLM took two of them (KV 0.2 -> 0.45) and has the two newest waiting
    f.on_snapshot(n.address, snap(0.45, waiting=2), 0.2)
    assert n.waiting_tokens == 4000 and n.prefill_tokens() == 3000
    assert n.projected_kv() == 0.45 + 4000 / 16000  # not 0.45: those two will need their KV soon
    f.place(500, 400, "r4", 0.3)  # sent after the reading: pending, not waiting
    assert n.projected_kv() == 0.45 + 4500 / 16000 and n.prefill_tokens() == 3400
    f.on_snapshot(n.address, snap(0.8, waiting=0), 0.4)
    assert n.waiting_tokens == 0 and n.projected_kv() == 0.8


def test_an_open_nodes_old_latency_does_not_keep_it_open() -> None:
    """An open node gets no traffic, so its probe keeps showing the last (slow) figure: that old figure
    must not re-open it when it is half-open and its trial requests come back fine."""
    f = fleet(2, breaker={"recovery_window_seconds": 5, "half_open_requests": 2})
    sick = f.nodes["10.0.0.0:8000"]
    for t in range(6):
        for i in range(2):
            f.on_snapshot(f"10.0.0.{i}:8000", stepping(f, 0.3, 1.0, at=t), t)
    for t in range(6, 9):
        f.on_snapshot(sick.address, stepping(f, 0.3, 20.0, at=t), t)
        f.on_snapshot("10.0.0.1:8000", stepping(f, 0.3, 1.0, at=t), t)
    assert sick.breaker.state is State.OPEN
    old = stepping(f, 0.3, 20.0, fresh=False, at=14)  # no step since: the histograms did not move
    f.on_snapshot(sick.address, old, 14)  # recovery window over: half-open; the reading is old news
    assert sick.breaker.state is State.HALF_OPEN
    for k in range(2):
        f.dispatched(sick.address, f"t{k}", 100, 80, 14.1)
        f.on_snapshot(sick.address, old, 14.2)
        f.completed(sick.address, f"t{k}", 100, True, 14.5)
    assert sick.breaker.state is State.CLOSED
