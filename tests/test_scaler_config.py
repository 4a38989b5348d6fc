"""The scaler's config (shipped example, errors naming fields), its direct source over real HTTP, and
per-pool state in the scaler shell."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import start_http_server

from ext_proc.admission import Decision, Rejection
from ext_proc.config import ConfigError, parse_config
from ext_proc.server import Gateway
from kvgate.dev.stack import free_port
from scaler.config import ScalerConfig, load_scaler_config
from scaler.law import Signals
from scaler.server import Scaler
from scaler.signals import DirectSource, PoolSignals, SourceError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "scaler.yaml"


def test_the_shipped_example_is_valid() -> None:
    cfg = load_scaler_config(EXAMPLE)
    pool = cfg.pools["llama-8b"]
    assert (pool.step, pool.warm_pool, pool.cooldown_seconds) == (2, 1, 600)
    assert cfg.source.kvgate and cfg.source.prometheus is None


@pytest.mark.parametrize(("text", "error"), [
    ("pools: {}\n", r"source: Field required"),
    ("source: {kvgate: ['http://a/metrics'], prometheus: 'http://p'}\n", r"source: .*not both"),
    ("source: {}\n", r"source: .*not both"),
    ("source: {kvgate: ['ftp://a']}\n", r"source\.kvgate\[0\]: String should match pattern"),
    ("source: {kvgate_dns: 'no-port'}\n", r"source\.kvgate_dns"),
    ("source: {prometheus: 'http://p'}\npools: {p: {scale_down_threshold: 0.3}}\n",
     r"pools\.p: .*scale_down_threshold: must be below scale_up_threshold"),
    ("source: {prometheus: 'http://p'}\npools: {p: {min_replicas: 4, max_replicas: 2}}\n",
     r"pools\.p: .*max_replicas: must be at least min_replicas"),
    ("source: {prometheus: 'http://p'}\npools: {p: {stepp: 2}}\n", r"pools\.p\.stepp"),
    ("source: {prometheus: 'http://p'}\npools: {none: {}}\n", r"pools\.none: 'none' is reserved"),
])
def test_bad_configs_name_the_field(tmp_path: Path, text: str, error: str) -> None:
    f = tmp_path / "scaler.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_scaler_config(f)


@pytest.fixture
def replica() -> Iterator[tuple[Gateway, int]]:
    """A kvgate replica's real metrics endpoint (its Gateway's registry over HTTP)."""
    gw = Gateway(parse_config({"tenants": [{"name": "a"}, {"name": "b"}]}))
    port = free_port()
    httpd, _ = start_http_server(port, addr="127.0.0.1", registry=gw.stats.registry)
    try:
        yield gw, port
    finally:
        httpd.shutdown()


def reject(gw: Gateway, tenant: str, status: int = 503, pool: str = "default") -> None:
    cls = "capacity" if status == 503 else "policy"
    gw.stats.decision(Decision(tenant, "standard", None, Rejection(status, "fleet-kv", cls, "")), pool)


def admit(gw: Gateway, tenant: str, pool: str = "default") -> None:
    gw.stats.decision(Decision(tenant, "standard", None, None), pool)


def test_direct_source_differences_counters_and_never_reads_a_lifetime_as_a_window(
        replica: tuple[Gateway, int]) -> None:
    gw, port = replica
    for _ in range(50):  # history from before the scaler started
        reject(gw, "a")
    src = DirectSource([], window_s=60, dns=f"127.0.0.1:{port}")
    first = src.read(0.0)
    assert not first.complete  # no baseline yet: the law holds
    admit(gw, "a")
    admit(gw, "b")
    reject(gw, "b")
    reject(gw, "b", 429)
    s = src.read(5.0)
    assert s.complete and s.admitted == {"a": 1, "b": 1}
    assert s.capacity_rejected == {"a": 0, "b": 1} and s.policy_rejected == {"b": 1}
    assert s.reject_rate == pytest.approx(1 / 3)


def test_direct_source_without_an_answering_replica(replica: tuple[Gateway, int]) -> None:
    _, port = replica
    src = DirectSource([f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{free_port()}/metrics"])
    src.read(0.0)
    assert not src.read(1.0).complete  # one replica silent: the sums would undercount, so hold
    with pytest.raises(SourceError, match="cannot resolve"):
        DirectSource([], dns="kvgate-metrics.invalid:9101").read(0.0)


def test_direct_source_reads_each_pool_apart(replica: tuple[Gateway, int]) -> None:
    gw, port = replica
    src = DirectSource([f"http://127.0.0.1:{port}/metrics"], window_s=60)
    reject(gw, "a", pool="big")  # before the scaler's first read: a lifetime, not the window
    assert not src.read_pools(0.0).complete
    admit(gw, "a", pool="small")
    admit(gw, "b", pool="big")
    reject(gw, "b", pool="big")
    reject(gw, "b", 429, pool="big")
    gw.stats.decision(Decision("a", "standard", None, Rejection(404, "model-not-found", "invalid", "")), "none")
    s = src.read_pools(5.0)
    assert s.complete and {"small", "big"} <= set(s) and "none" not in s
    assert s["small"].admitted == {"a": 1} and s["small"].capacity_total == 0 and s["small"].reject_rate == 0
    assert s["big"].admitted == {"b": 1} and s["big"].capacity_rejected == {"a": 0, "b": 1}
    assert s["big"].policy_rejected == {"b": 1} and s["big"].reject_rate == pytest.approx(1 / 2)
    fleet = s.fleet()  # what read() gives: every pool's sum
    assert fleet.admitted == {"a": 1, "b": 1} and fleet.reject_rate == pytest.approx(1 / 3)
    # a pool kvgate does not report, on a complete read: zero demand, not missing data
    assert not s.reported("idle") and s.of("idle") == Signals(5.0) and s.of("idle").complete
    assert s.of("big") is s["big"] and s.reported("big")


def test_pool_signals_without_pools_in_kvgate_are_every_scaler_pools() -> None:
    fleet = Signals(1.0, {"a": 8}, {"a": 2}, {}, 1.0, 3, True, kv_usage=0.5)
    one = PoolSignals.single(fleet)  # a kvgate without pools (or older than pools) reports only "default"
    assert one.shared and one.of("vllm") is fleet and one.of("default") is fleet and one.reported("vllm")
    two = PoolSignals(1.0, {"default": fleet, "big": Signals(1.0, {"b": 1}, {}, {}, 0.0, 1, True, kv_usage=1.0)})
    assert not two.shared and not two.reported("vllm") and two.of("vllm").demand == 0  # named pools: by name
    assert two.of("default") is fleet
    f = two.fleet()
    assert (f.admitted, f.replicas, f.held, f.demand) == ({"a": 8, "b": 1}, 4, 1.0, 11)
    assert f.kv_usage == pytest.approx((0.5 * 3 + 1.0) / 4)  # averaged over the replicas, not the pools
    partial = PoolSignals(1.0, {"big": two["big"]}, complete=False)
    assert not partial.of("small").complete  # a replica did not answer: missing data, never zero demand


class Fixed:
    def __init__(self, sig: Signals) -> None:
        self.sig = sig

    def read(self, now: float) -> Signals:
        return self.sig


async def test_each_pool_keeps_its_own_policy_problem_gauge() -> None:
    cfg = ScalerConfig.model_validate({"source": {"prometheus": "http://p"},
                                       "pools": {"x": {}, "y": {"concentration": 0.95}}})
    flood = Signals(0.0, {"a": 10, "rag": 10}, {"rag": 30}, {"rag": 60}, 0, 2, True)  # rag: 90 of 90 rejections
    s = Scaler(cfg, Fixed(flood))
    s.evaluate(0.0)
    await asyncio.sleep(0)
    got = {(m.labels["pool"], m.labels["tenant"]) for fam in s.m_policy.collect() for m in fam.samples}
    assert got == {("x", "rag"), ("y", "rag")}  # the second pool's verdict did not wipe the first's
