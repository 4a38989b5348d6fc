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
        f.dispatched(n.address, 1000, 0.1)
    assert n.projected_kv() == 0.5 + 6000 / 16000
    c = f.choose(1000, 0.2)
    assert c.node is None and c.reason == "fleet-kv" and c.retry_after is not None
    f.on_snapshot(n.address, snap(0.5), 0.3)  # a reading taken after those dispatches includes them
    assert n.projected_kv() == 0.5 and f.choose(1000, 0.3).node is n


def test_open_breaker_filters_the_node() -> None:
    f = fleet()
    feed(f, 0, 0.96, 0.3)  # node 0 trips (kv > 0.95)
    assert f.nodes["10.0.0.0:8000"].breaker.state is State.OPEN
    feed(f, 1, 0.1, 0.3)  # still open although it reads fine now: recovery window first
    assert {f.choose(1, 1).node.address for _ in range(20)} == {"10.0.0.1:8000"}  # type: ignore[union-attr]
    f.on_snapshot("10.0.0.1:8000", snap(0.97), 1)
    c = f.choose(1, 1)
    assert c.node is None and c.reason == "fleet-breakers-open"
    assert 28 < c.retry_after <= 30  # type: ignore[operator]  # until node 0's recovery window ends


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
        f.dispatched(n.address, 10, 0.1)
        picks[n.address] += 1
    assert len(picks) == 4 and min(picks.values()) > 60


def test_half_open_trials_then_close() -> None:
    f = fleet(1, breaker={"recovery_window_seconds": 1, "half_open_requests": 2})
    n = f.nodes["10.0.0.0:8000"]
    for t in range(3):
        f.on_snapshot(n.address, snap(0.3), t)
    f.on_snapshot(n.address, snap(0.99), 3)
    assert n.breaker.state is State.OPEN and f.choose(1, 3.5).node is None
    f.on_snapshot(n.address, snap(0.3), 4.1)
    assert n.breaker.state is State.HALF_OPEN
    for _ in range(2):
        c = f.choose(1, 4.2)
        assert c.node is n
        f.dispatched(n.address, 1, 4.2)
    assert f.choose(1, 4.2).node is None  # trial budget spent
    f.completed(n.address, 1, True, 4.5)
    f.completed(n.address, 1, True, 4.6)
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
