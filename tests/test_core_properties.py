"""Property tests of the gateway core over random event sequences (hypothesis' stateful testing).

Whatever happens — decisions, queueing, every way a request can end, cancellations, expiries, an
Envoy gone, reloads that drop tenants or shrink the queue, probe readings, nodes dying — these hold
after every step:

* each tenant's in-flight count equals its open leases (sent or queued);
* every ticket ends exactly once (a second end of the same ticket releases nothing);
* with usage never above the reservation, no token budget ever goes below zero (never overrun);
* a best-effort admission (a tenant over a protective limit served from spare room) holds a fleet slot
  and no quota, never waits in the queue, and ends exactly once like any other;
* every state gauge kvgate exports equals the state it reports;
* after everything ends, nothing is held anywhere.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.admission import Usage
from ext_proc.config import parse_config
from ext_proc.core import Answer, Core, Ended, Held, Request, null_logger
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from gpu_probe.snapshot import Snapshot
from tests.helpers import FakeClock

TENANTS = ["chat", "rag", "batch"]
NODES = ["10.0.0.1:8000", "10.0.0.2:8000", "[::1]:8000"]


MODELS = ["small-m", "big-m", "nope", None]
POOL_NODES = {"small": NODES[:2], "big": NODES[2:]}


OVER_LIMIT: dict[str, Any] = {"chat": None, "rag": {"concurrency": "best-effort"}, "batch": "best-effort"}
"""Best effort: batch over any protective limit, rag over its concurrency cap only (its budgets refuse)."""


def config(max_size: int = 8, drop: str | None = None, conc: int = 3, pools: bool = False,
           best_effort: bool = True) -> Any:
    tiers = {"chat": "interactive", "rag": "standard", "batch": "batch"}
    tenants: list[dict[str, Any]] = [
        {"name": n, "api_key_sha256": [hash_key("k-" + n)], "tier": tiers[n], "max_concurrent": conc,
         "tokens_per_minute": 6000, "requests_per_minute": 120, "over_limit": OVER_LIMIT[n]}
        for n in TENANTS if n != drop
    ]
    switch = {"best_effort": {"enabled": best_effort}}
    nodes = lambda addrs: {"static": [{"address": a, "probe": f"http://{a}"} for a in addrs],  # noqa: E731
                           "max_waiting_requests": 2, "max_prefill_tokens": 4000}
    if not pools:
        return parse_config({"tenants": tenants, "queue": {"max_size": max_size}, "nodes": nodes(NODES), **switch})
    for t in tenants:  # rag has its own budget on the big model; batch may not use it
        if t["name"] == "rag":
            t["model_budgets"] = {"big-*": {"tokens_per_minute": 3000, "max_concurrent": 1}}
        if t["name"] == "batch":
            t["models"] = ["small-m"]
    return parse_config({
        "tenants": tenants, "queue": {"max_size": max_size}, **switch,
        "pools": [{"name": "small", "models": ["small-m"], "nodes": nodes(POOL_NODES["small"])},
                  {"name": "big", "models": ["big-*"], "nodes": nodes(POOL_NODES["big"]),
                   "queue": {"max_size": max(1, max_size // 2)}}],
    })


def metrics(core: Core) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    out = {}
    for fam in text_string_to_metric_families(generate_latest(core.stats.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class CoreMachine(RuleBasedStateMachine):
    POOLS = False

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.core = Core(config(pools=self.POOLS), self.clock, log=null_logger())
        self.seq = 0
        self.open: dict[str, tuple[str, int]] = {}
        """Admitted, not ended: ticket → (request id, reserved tokens)."""
        self.held: dict[str, str] = {}
        """Queued: request id → ticket."""
        self.ended: set[str] = set()
        self.envoys_up: set[str] = set()
        self.best_effort = 0
        """Best-effort admissions seen in this run."""
        for node in NODES:  # the nodes start alive; rules make them full, stale or gone
            self.snapshot(node, 0.2, 0)

    # -- events ------------------------------------------------------------------------------------

    def _answer(self, a: Answer) -> None:
        lease = a.decision.lease
        if a.decision.best_effort is not None:
            assert lease is not None and lease.best_effort and not lease.charged
            assert (a.held is None) == (lease.queued_at is None), "sent at once, or after waiting for room"
            assert a.decision.best_effort.reason in ("tenant-concurrency", "tenant-requests", "tenant-tokens")
            assert a.decision.tenant != "chat", "a tenant whose limits refuse is never served as best effort"
            assert a.decision.best_effort.reason == "tenant-concurrency" or a.decision.tenant == "batch"
            self.best_effort += 1
        if a.ticket is not None and a.decision.admitted:
            assert a.ticket not in self.open and a.ticket not in self.ended
            self.open[a.ticket] = (a.request_id, a.decision.lease.reserved_tokens if a.decision.lease else 0)

    def _drain_answers(self) -> None:
        for a in self.core.answers():
            ticket = self.held.pop(a.request_id, None)
            assert ticket is not None, "an answer for a request that was not waiting"
            self._answer(a)

    @rule(tenant=st.sampled_from([*TENANTS, "intruder"]), prompt=st.integers(1, 3000),
          output=st.integers(1, 800), envoy=st.sampled_from(["e1", "e2"]), model=st.sampled_from(MODELS))
    def request(self, tenant: str, prompt: int, output: int, envoy: str, model: str | None) -> None:
        self.seq += 1
        rid = f"r{self.seq}"
        out = self.core.decide(Request("/v1/chat/completions", rid, f"Bearer k-{tenant}", envoy=envoy,
                                       estimate=Estimate(prompt, output, True, model=model), body_bytes=prompt * 4))
        if self.POOLS and isinstance(out, Answer) and out.decision.lease is not None:
            # routed by model: its node is one of its pool's
            assert out.decision.lease.node is None or out.decision.lease.node in POOL_NODES[out.pool]
            assert model is not None and model.split("-")[0] == out.pool
        if self.POOLS and isinstance(out, Answer) and model in ("nope", None):
            assert out.reply is not None and out.reply.status in (400, 401, 404) and out.pool == "none"
        if self.POOLS and isinstance(out, Answer) and tenant == "batch" and model == "big-m" and \
                self.core.config.tenant("batch") is not None:
            assert out.reply is not None and out.reply.status == 403
        if isinstance(out, Held):
            self.held[rid] = out.ticket
        else:
            self._answer(out)
        self._drain_answers()

    @rule(tenant=st.sampled_from(["batch", "rag"]), n=st.integers(1, 6), envoy=st.sampled_from(["e1", "e2"]))
    def burst(self, tenant: str, n: int, envoy: str) -> None:
        """Short requests of one tenant at once: past its concurrency cap, best effort where there is room."""
        for _ in range(n):
            self.request(tenant, 50, 20, envoy, "small-m" if self.POOLS else None)

    @rule(data=st.data(), how=st.sampled_from(["ok", "no_usage", "disconnect", "upstream_error", "aborted",
                                               "twice"]))
    def end(self, data: st.DataObject, how: str) -> None:
        if not self.open:
            return
        ticket = data.draw(st.sampled_from(sorted(self.open)))
        rid, reserved = self.open.pop(ticket)
        usage = Usage(reserved // 2, reserved - reserved // 2) if how in ("ok", "twice") else None
        e = {
            "ok": Ended(ticket, rid, 200, usage, upstream_answered=True),
            "twice": Ended(ticket, rid, 200, usage, upstream_answered=True),
            "no_usage": Ended(ticket, rid, 200, None, upstream_answered=True),
            "disconnect": Ended(ticket, rid, 0, None, disconnected=True),
            "upstream_error": Ended(ticket, rid, 503, None),
            "aborted": Ended(None, rid, 503, None),
        }[how]
        assert self.core.ended(e) is not None, "an open lease must release"
        self.ended.add(ticket)
        if how == "twice":
            assert self.core.ended(e) is None, "a ticket ended twice released twice"
            assert self.core.ended(Ended(None, rid, 503)) is None
        self._drain_answers()

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if not self.held:
            return
        rid = data.draw(st.sampled_from(sorted(self.held)))
        ticket = self.held.pop(rid)
        self.core.cancel(ticket)
        self._drain_answers()

    @rule(dt=st.floats(0.01, 40.0))
    def time_passes(self, dt: float) -> None:
        self.clock.advance(dt)
        self.core.tick()
        self._drain_answers()

    @rule(envoy=st.sampled_from(["e1", "e2"]), up=st.booleans())
    def envoy(self, envoy: str, up: bool) -> None:
        if up and envoy not in self.envoys_up:
            self.core.envoy_up(envoy)
            self.envoys_up.add(envoy)
        elif not up and envoy in self.envoys_up:
            self.core.envoy_down(envoy)
            self.envoys_up.discard(envoy)
            self.clock.advance(5.0)
            self.core.tick()  # its requests died with it
            self._drain_answers()
            self._sync_reclaimed()
            assert not any(self.core._envoy_of.get(t) == envoy for t in self.open), "a dead Envoy's lease held"

    @rule(max_size=st.integers(1, 10), drop=st.sampled_from([None, *TENANTS]), conc=st.integers(1, 4),
          best_effort=st.booleans())
    def reload(self, max_size: int, drop: str | None, conc: int, best_effort: bool) -> None:
        self.core.reconfigure(config(max_size, drop, conc, self.POOLS, best_effort))
        self._drain_answers()

    @rule(node=st.sampled_from(NODES), kv=st.floats(0.0, 1.0), waiting=st.integers(0, 4))
    def snapshot(self, node: str, kv: float, waiting: int) -> None:
        snap = Snapshot(node=node, at=self.clock(), ok=True, kv_usage=kv, blocks_total=2000, block_size=16,
                        waiting=float(waiting), running=1.0)
        self.core.snapshot(node, snap, 0.0)
        self._drain_answers()

    @rule(keep=st.integers(0, 3))
    def nodes_change(self, keep: int) -> None:
        if self.POOLS:
            for pool, addrs in POOL_NODES.items():
                self.core.set_nodes([(a, f"http://{a}", None) for a in addrs[:keep]], pool)
        else:
            self.core.set_nodes([(a, f"http://{a}", None) for a in NODES[:keep]])
        self._drain_answers()

    # -- what must hold --------------------------------------------------------------------------

    def _sync_reclaimed(self) -> None:
        """Leases the core released by itself (reclaim, Envoy gone) end exactly once too."""
        live = {lease.ticket for lease in self.core.admission.leases()}
        for t in [t for t in self.open if t not in live]:
            self.open.pop(t)
            self.ended.add(t)

    @invariant()
    def inflight_equals_leases(self) -> None:
        self._sync_reclaimed()
        a = self.core.admission
        leases = a.leases(queued=True)
        for t in a.tenants():
            mine = sum(1 for lease in leases if lease.tenant is t and lease.charged)
            assert t.inflight == mine, (t.name, t.inflight, mine)
        for b in a._model_budgets.values():  # a per-model budget counts what it holds, like its tenant
            mine = sum(1 for lease in leases if lease.budget is b and lease.charged)
            assert b.inflight == mine, (b.name, b.inflight, mine)
        assert a.inflight == sum(1 for lease in a.leases() if lease.charged or lease.best_effort)
        for lease in a.leases(queued=True):  # best effort holds no quota and never waits
            assert not (lease.best_effort and (lease.charged or lease.ticket in a._held))
            assert not lease.best_effort or all(lease.ticket not in t.leases for t in a.states())
        for pool, q in a.queues.items():  # each queued request waits in its own pool's queue
            assert len(q) == sum(1 for h in a._held.values() if h.lease.pool == pool), pool
        assert {lease.ticket for lease in a.leases()} == set(self.open)
        assert a.queued == len(self.held)

    @invariant()
    def budgets_never_overrun(self) -> None:
        now = self.clock()
        for t in self.core.admission.states():
            for b in (t.tokens, t.requests):
                if b is not None:
                    assert b.available(now) >= -1e-6, (t.name, b.available(now))

    @invariant()
    def gauges_equal_state(self) -> None:
        m = metrics(self.core)
        a = self.core.admission
        per: dict[str, int] = {}
        for lease in a.leases(queued=True):
            if lease.charged:  # a removed tenant's requests are reported as "other" until they end
                label = self.core.stats.label(lease.tenant.name)
                per[label] = per.get(label, 0) + 1
        for name in [*TENANTS, "unknown", "other"]:
            got = sum(v for (n, labels), v in m.items()
                      if n == "kvgate_inflight_requests" and ("tenant", name) in labels)
            assert got == per.get(name, 0)
        assert all(v >= 0 for (n, _), v in m.items() if n == "kvgate_inflight_requests")
        for pool in self.core.fleets:
            sent = sum(1 for lease in a.leases() if (lease.charged or lease.best_effort) and lease.pool == pool)
            assert m[("kvgate_fleet_inflight_requests", (("pool", pool),))] == sent
        assert sum(v for (n, _), v in m.items() if n == "kvgate_fleet_inflight_requests") == a.inflight
        depth = sum(v for (n, _), v in m.items() if n == "kvgate_queue_depth_requests")
        waiting = sum(v for (n, _), v in m.items() if n == "kvgate_best_effort_waiting_requests")
        assert depth + waiting == a.queued
        assert self.core.fleets
        for pool, fleet in self.core.fleets.items():
            for n in fleet.nodes.values():
                assert m[("kvgate_node_inflight_requests", (("node", n.address), ("pool", pool)))] == n.inflight

    @precondition(lambda self: True)
    @rule()
    def everything_ends(self) -> None:
        """End all that is open, let every queued request time out: nothing may be left anywhere."""
        for ticket, (rid, _) in list(self.open.items()):
            assert self.core.ended(Ended(ticket, rid, 200, None, upstream_answered=True)) is not None
            self.open.pop(ticket)
            self.ended.add(ticket)
        self._drain_answers()
        for _ in range(3):
            self.clock.advance(61.0)
            self.core.tick()
            self._drain_answers()
            for ticket, (rid, _) in list(self.open.items()):
                self.core.ended(Ended(ticket, rid, 200, None, upstream_answered=True))
                self.open.pop(ticket)
                self.ended.add(ticket)
        a = self.core.admission
        assert a.open_leases == 0 and a.queued == 0 and a.inflight == 0
        assert all(t.inflight == 0 for t in a.states())
        assert self.core.fleets
        assert all(n.inflight == 0 for f in self.core.fleets.values() for n in f.nodes.values())


CoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestCore = CoreMachine.TestCase


class PoolMachine(CoreMachine):
    """The same, with two model pools (each its own nodes and queue), a per-model budget and a model a
    tenant may not use: requests reach only their pool's nodes, budgets hold like tenants do."""

    POOLS = True


PoolMachine.TestCase.settings = CoreMachine.TestCase.settings
TestPools = PoolMachine.TestCase
