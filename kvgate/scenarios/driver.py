"""One policy over one trace, in virtual time: kvgate's own decision core in front of simulated nodes.

What runs here is what runs in the live server, minus the transport: ``ext_proc.core.Core``, the
gateway core the gRPC server drives too (identity, quotas, tiers, the fair queue, node choice,
breakers, completions), fed by the probe's own ``gpu_probe.snapshot.Deriver``, and
``scaler.law.ControlLaw``; the nodes are ``sim.engine.Engine`` (the vLLM v1 scheduler mirror and
step-time model). This module only plays the transport: requests in, answers out, the end of each
request, the core's tick every 50 ms, probe readings every ``nodes.poll_interval_seconds``. Each
tenant of the config gets an API key for the run and every request carries it, so identity is the
production path too; the one shortcut is that token counts are known exactly (no body is built and
estimated).

Simplifications, all documented in the README: a probe reads its node every ``PROBE_INTERVAL_S``
(the default ``kvgate probe --interval``) with no network delay; TTFT/queue observations enter the
probe's histograms when a request finishes (vLLM observes TTFT at the first token); clients do not
retry a rejection; a node being removed first drains its requests.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ext_proc.admission import Decision, Usage
from ext_proc.config import Config, parse_config
from ext_proc.core import Answer, Core, Ended, Held, null_logger
from ext_proc.core import Request as GatewayRequest
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from ext_proc.prefix import segment_chain
from gpu_probe.parse import EngineReading
from gpu_probe.snapshot import Deriver
from scaler.law import ControlLaw, LawSettings, Signals
from scaler.signals import BUDGET_REASONS, KINDS
from sim.engine import Engine, EngineOptions
from sim.prefix_cache import Prompt
from sim.profiles import Profile
from sim.scheduler import Request

from .trace import TraceRequest

PUMP_INTERVAL_S = 0.05
"""As ``ext_proc.server.TICK_S``."""
PROBE_INTERVAL_S = 0.5
"""As ``kvgate probe --interval``'s default."""
CHARS_PER_TOKEN = 4

BREAKER_CAUSES = ("latency", "kv", "trial")
"""A breaker's opening by cause (``ext_proc.breaker.open_cause``, what kvgate's metric counts): a latency
trip, a KV trip, or a re-open while half-open (a trial failed or the node still read unhealthy)."""

Admit = Literal["none", "kv-shed", "kvgate"]
Autoscale = Literal["none", "queue", "scaler"]


@dataclass(frozen=True)
class Policy:
    """What stands in front of the nodes."""

    name: str
    nodes: int
    admission: Admit = "none"
    autoscale: Autoscale = "none"
    min_nodes: int = 1
    max_nodes: int = 16
    ideal: bool = False
    """A scenario's ideal reference (``workloads.Ideal``), not a policy to compare as one."""
    prefix: bool = True
    """kvgate's prefix-cache awareness (``nodes.prefix.enabled``); False: the ``kvgate-noprefix`` policy."""

    @property
    def label(self) -> str:
        return f"{self.name} ({self.nodes}{'+' if self.autoscale != 'none' else ''} nodes)"

    def configure(self, base: Config, profile: str | None = None) -> Config:
        """The kvgate config this policy runs with; every tenant gets the run's API key. ``profile``: the
        simulated nodes' step-time profile, the prior of kvgate's performance model unless the config
        names one (what an operator sets in ``nodes.performance`` for the model and GPU the pool runs)."""
        doc = kv_shed_config(base) if self.admission == "kv-shed" else base.model_dump(mode="json")
        if profile is not None and base.nodes is not None and "performance" not in base.nodes.model_fields_set:
            doc.setdefault("nodes", {})["performance"] = {"profile": profile}
        if not self.prefix and doc.get("nodes") is not None:
            doc["nodes"]["prefix"] = {**(doc["nodes"].get("prefix") or {}), "enabled": False}
        for t in doc.get("tenants", []):
            t["api_key_sha256"] = [hash_key(run_key(t["name"]))]
        return parse_config(doc)


def run_key(tenant: str) -> str:
    """The API key a tenant's requests carry in virtual time."""
    return f"sk-bench-{tenant}"


@dataclass(frozen=True)
class Autoscaling:
    """Settings of both autoscalers. ``queue``: what KEDA on vLLM's queue depth does (HPA AverageValue
    of ``vllm:num_requests_waiting``, its default 300 s scale-down stabilisation); ``scaler``: kvgate's
    control law on capacity rejections."""

    interval_s: float = 15.0
    """KEDA's pollingInterval."""
    waiting_per_node: float = 4.0
    """The queue autoscaler's target: requests waiting in vLLM per node."""
    scale_down_window_s: float = 300.0
    window_s: float = 60.0
    """The scaler's signal window."""
    law: LawSettings = field(default_factory=lambda: LawSettings(min_replicas=1, max_replicas=16, step=2,
                                                                  cooldown_s=600.0))


@dataclass(frozen=True)
class Degrade:
    """At ``at`` the node ``node`` (index) slows down by ``factor`` (1 = healthy again)."""

    at: float
    node: int
    factor: float


@dataclass(frozen=True)
class Outage:
    """From ``start`` to ``end`` (virtual seconds) the node ``node`` (index) is out of service: plain
    least-request routing (the ``none`` admission) sends it no new request; what it already runs
    finishes there at its normal speed. An ideal reference's way of taking a sick node out exactly
    while it is sick (no detection delay, no false positives)."""

    start: float
    end: float
    node: int

    def covers(self, node: int, t: float) -> bool:
        return node == self.node and self.start <= t < self.end


@dataclass
class Outcome:
    """What the client saw for one trace request."""

    req: TraceRequest
    tier: str
    status: int = 0
    """200, or the rejection's status; 0 while undecided."""
    reason: str = ""
    klass: str = ""
    """policy | capacity | invalid | auth | '' (admitted)."""
    ttft: float | None = None
    e2e: float | None = None
    node: int | None = None
    decided_at: float | None = None


@dataclass
class SimNode:
    index: int
    address: str
    engine: Engine
    provisioned_at: float
    ready_at: float
    state: Literal["loading", "ready", "draining", "gone"] = "loading"
    stopped_at: float | None = None
    busy: bool = False
    deriver: Deriver = field(init=False)
    hist: dict[str, list[float]] = field(default_factory=dict)
    snapshot_at: float = -1.0
    snapshot: Any = None

    def __post_init__(self) -> None:
        self.deriver = Deriver(self.address)

    def observe(self, name: str, value: float) -> None:
        h = self.hist.get(name)
        if h is None:
            self.hist[name] = [value, 1.0]
        else:
            h[0] += value
            h[1] += 1.0

    def reading(self) -> EngineReading:
        e = self.engine
        s = e.scheduler
        return EngineReading(self.engine.profile.model_name, "0", kv_usage=s.kv_usage,
                             kv_metric="vllm:kv_cache_usage_perc",
                             running=float(len(s.running)), waiting=float(s.num_waiting),
                             counters={"preemptions": float(s.preemptions),
                                       "generation_tokens": float(s.generation_tokens)},
                             hist={**{k: (v[0], v[1]) for k, v in self.hist.items()},
                                   "itl": (e.itl_sum, float(e.itl_count)),
                                   "iteration": (float(e.step_tokens), float(e.steps))},
                             num_gpu_blocks=s.cfg.num_gpu_blocks, block_size=s.cfg.block_size)

    @property
    def load(self) -> int:
        s = self.engine.scheduler
        return len(s.running) + s.num_waiting


@dataclass
class RunResult:
    policy: Policy
    outcomes: list[Outcome]
    duration_s: float
    """From the first arrival to the last request's end."""
    gpu_seconds: float
    gpus_per_node: int
    node_timeline: list[tuple[float, int]]
    """(time, nodes provisioned) at every change."""
    breaker_opens: int
    lost: int
    breaker_opens_by_cause: dict[str, int] = field(default_factory=dict)
    """``breaker_opens`` split by cause (latency | kv | trial), as kvgate's core classifies them."""
    prefill_tokens_computed: int = 0
    """Prompt tokens the nodes actually prefilled: what they were asked for less their prefix-cache hits."""


def _content(i: int, r: TraceRequest) -> Prompt | None:
    """What the node can cache of a trace request's prompt: its shared segments, then its own tokens."""
    if not r.segments:
        return None
    own = r.prompt_tokens - sum(n for _, n in r.segments)
    return Prompt.from_segments([*r.segments, *([(f"\x00r{i}", own)] if own > 0 else [])])


def _slowed(p: Profile, factor: float) -> Profile:
    return replace(p, a_ms=p.a_ms * factor, b_ms_per_prefill_token=p.b_ms_per_prefill_token * factor,
                   c_ms_per_decode_seq=p.c_ms_per_decode_seq * factor,
                   d_ms_per_context_token=p.d_ms_per_context_token * factor)


def kv_shed_config(base: Config) -> dict[str, Any]:
    """The Gateway API Inference Extension's approach on kvgate's core: KV/queue-threshold shedding and
    KV-aware picking, no tenants (every tenant unlimited and alike), no gateway queue, no breakers."""
    nodes = base.nodes.model_dump(mode="json") if base.nodes is not None else {}
    nodes["breaker"] = {"kv_threshold": 1.0, "close_kv": 0.99, "latency_multiplier": 1e9,
                        "close_latency_multiplier": 1e9 - 1}
    nodes["prefix"] = {**(nodes.get("prefix") or {}), "enabled": False}  # KV-aware picking only
    return {"tenants": [{"name": t.name} for t in base.tenants], "queue": {"enabled": False}, "nodes": nodes}


class Run:
    """The event loop. Events: arrivals (from the trace), node step ends, the pump/probe tick, the
    autoscaler's tick, node start-ups and scenario events (a node slowing down). ``outages`` (plain
    least-request only) take a node out of node choice for a window; they need no event."""

    def __init__(self, config: Config, policy: Policy, profile: Profile, trace: list[TraceRequest],
                 seed: int = 0, engine: EngineOptions | None = None, autoscaling: Autoscaling | None = None,
                 cold_start_s: float | None = None, degrade: tuple[Degrade, ...] = (),
                 outages: tuple[Outage, ...] = ()) -> None:
        if outages and policy.admission != "none":
            raise ValueError("outages apply to plain least-request routing (admission none) only")
        self.now = 0.0
        self.policy = policy
        self.profile = profile
        self.trace = trace
        self.seed = seed
        self.auto = autoscaling or Autoscaling()
        self.cold_start_s = profile.cold_start_s if cold_start_s is None else cold_start_s
        self.degrade = sorted(degrade, key=lambda d: d.at)
        self.outages = tuple(outages)
        self.base_config = config
        self.config = config = policy.configure(config, profile.name)
        priority = policy.admission == "kvgate" and config.queue.inject_priority
        self.engine_options = replace(engine or EngineOptions(), policy="priority" if priority else "fcfs")
        base = self.base_config  # tiers for the report: the same for every policy
        self.tiers = {t.name: t.tier for t in base.tenants}
        self.outcomes = [Outcome(r, self.tiers.get(r.tenant, base.lowest_tier)) for r in trace]
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.nodes: list[SimNode] = []
        self._by_address: dict[str, SimNode] = {}
        self.node_timeline: list[tuple[float, int]] = []
        self.breaker_opens = 0
        self.transitions: list[tuple[float, str, str, str, str]] = []
        self._inflight: dict[Request, tuple[int, str | None]] = {}
        """Engine request → (outcome index, kvgate ticket)."""
        self._held: dict[str, int] = {}
        """Request id of a queued request → outcome index."""
        self._decisions: deque[tuple[float, str, str]] = deque()
        """(time, kind, tenant) for the scaler's window: admitted | capacity | policy, and besides those
        budget (a policy 429 for the tenant's own budget), fleet (a 429 the fleet caused), slo_miss (admitted,
        predicted to miss its TTFT target)."""
        self._desired_history: deque[tuple[float, int]] = deque()
        self._next_poll = 0.0
        self.core: Core | None = None
        self.law: ControlLaw | None = None
        if policy.admission != "none":
            if config.nodes is None:
                raise ValueError("the scenario's kvgate config needs a nodes section")
            self.core = Core(config, lambda: self.now, rng=random.Random(seed), log=null_logger(),
                             on_transition=self._transition)
        if policy.autoscale == "scaler":
            self.law = ControlLaw(replace(self.auto.law, min_replicas=policy.min_nodes,
                                          max_replicas=policy.max_nodes, cold_start_s=self.cold_start_s,
                                          window_s=self.auto.window_s))
        for _ in range(policy.nodes):
            self._provision(ready=True)
        self.node_timeline = [(trace[0].t if trace else 0.0, policy.nodes)]

    # -- nodes -------------------------------------------------------------------------------------

    def _provision(self, ready: bool = False) -> SimNode:
        i = len(self.nodes)
        opts = replace(self.engine_options, seed=self.seed * 1000 + i)
        n = SimNode(i, f"node-{i}:8000", Engine(self.profile, opts), self.now,
                    self.now if ready else self.now + self.cold_start_s)
        n.engine.every_token = False
        self.nodes.append(n)
        self._by_address[n.address] = n
        if ready:
            self._ready(n)
        else:
            self._push(n.ready_at, "ready", n)
        self._timeline()
        return n

    def _ready(self, n: SimNode) -> None:
        if n.state != "loading":
            return
        n.state = "ready"
        self._sync_fleet()
        if self.core is not None:  # the probe's first reading arrives with the node
            self._probe(n)

    def _retire(self, count: int) -> None:
        """Remove ``count`` nodes: loading ones first (cancelled), then the least loaded ready ones,
        which drain before they stop."""
        for n in sorted((n for n in self.nodes if n.state in ("loading", "ready")),
                        key=lambda n: (n.state != "loading", n.load))[:count]:
            if n.state == "loading":
                n.state, n.stopped_at = "gone", self.now
            else:
                n.state = "draining"
                self._maybe_gone(n)
        self._sync_fleet()
        self._timeline()

    def _maybe_gone(self, n: SimNode) -> None:
        if n.state == "draining" and not n.engine.scheduler.has_work() and not n.busy:
            n.state, n.stopped_at = "gone", self.now
            self._timeline()

    def _sync_fleet(self) -> None:
        if self.core is not None:
            self.core.set_nodes([(n.address, f"http://{n.address}", None) for n in self.nodes if n.state == "ready"])
            self._answers()

    def _timeline(self) -> None:
        count = sum(1 for n in self.nodes if n.state != "gone")
        if not self.node_timeline or self.node_timeline[-1][1] != count:
            self.node_timeline.append((self.now, count))

    def _transition(self, node: str, old: Any, new: Any, why: str) -> None:
        self.transitions.append((self.now, node, old.value, new.value, why))
        if new.value == "open":
            self.breaker_opens += 1

    @property
    def breaker_opens_by_cause(self) -> dict[str, int]:
        """``breaker_opens`` by cause, as kvgate's core counts them for its metric (``open_cause``)."""
        core = self.core
        return {c: core.breaker_opens.get(c, 0) if core is not None else 0 for c in BREAKER_CAUSES}

    def _probe(self, n: SimNode) -> None:
        if self.now - n.snapshot_at >= PROBE_INTERVAL_S - 1e-9:
            n.snapshot = n.deriver.update({(n.engine.profile.model_name, "0"): n.reading()}, self.now)
            n.snapshot_at = self.now
        assert self.core is not None
        self.core.snapshot(n.address, n.snapshot, self.now - n.snapshot_at)

    # -- events ------------------------------------------------------------------------------------

    def _push(self, t: float, kind: str, arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, arg))

    def _kick(self, n: SimNode) -> None:
        if n.busy:
            return
        dt = n.engine.begin_step(self.now)
        if dt is not None:
            n.busy = True
            self._push(self.now + dt, "step", n)

    def _send(self, i: int, n: SimNode, ticket: str | None) -> None:
        o = self.outcomes[i]
        r = o.req
        tier = self.config.tiers.get(o.tier)
        prio = 0
        if tier is not None and self.engine_options.policy == "priority":
            prio = tier.vllm_priority if tier.vllm_priority is not None else tier.priority
        sreq = Request(f"r{i}", r.prompt_tokens, r.output_tokens, self.now, priority=prio, content=_content(i, r))
        n.engine.add(sreq)
        self._inflight[sreq] = (i, ticket)
        o.status, o.node, o.decided_at = 200, n.index, self.now
        self._kick(n)

    def _reject(self, i: int, status: int, reason: str, klass: str) -> None:
        o = self.outcomes[i]
        o.status, o.reason, o.klass, o.decided_at = status, reason, klass, self.now
        if klass in ("capacity", "policy"):
            self._decisions.append((self.now, klass, o.req.tenant))
        if klass == "policy" and reason in BUDGET_REASONS:
            self._decisions.append((self.now, "budget", o.req.tenant))

    def _arrive(self, i: int) -> None:
        r = self.outcomes[i].req
        if self.core is None:
            ready = [n for n in self.nodes if n.state == "ready" and not self._out(n)]
            if not ready:
                self._reject(i, 503, "no-node", "capacity")
                return
            self._send(i, min(ready, key=lambda n: n.load), None)  # plain Envoy's least-request
            self._decisions.append((self.now, "admitted", r.tenant))
            return
        est = Estimate(r.prompt_tokens, r.reserved_output, parsed=True, stream=r.stream,
                       prefix=self._prefix_chain(r))
        req = GatewayRequest("/v1/chat/completions", f"r{i}", f"Bearer {run_key(r.tenant)}",
                      estimate=est, body_bytes=r.prompt_tokens * CHARS_PER_TOKEN + 200)
        out = self.core.decide(req)
        if isinstance(out, Held):
            self._held[out.request_id] = i
        else:
            assert isinstance(out, Answer), "one process, no store: nothing to borrow"
            self._decided(i, out.decision)
        self._answers()

    def _prefix_chain(self, r: TraceRequest) -> tuple[int, ...]:
        """kvgate's view of a trace request's prefix (no text in virtual time: its segments)."""
        nodes = self.config.nodes
        if not r.segments or nodes is None or not nodes.prefix.enabled:
            return ()
        return segment_chain(r.segments, nodes.prefix.max_blocks_per_request, nodes.prefix.block_tokens)

    def _out(self, n: SimNode) -> bool:
        """Out of service now (an ``Outage``)."""
        return any(o.covers(n.index, self.now) for o in self.outages)

    def _answers(self) -> None:
        """Requests the core decided out of its queue."""
        assert self.core is not None
        a: Answer
        for a in self.core.answers():
            i = self._held.pop(a.request_id, None)
            if i is not None:
                self._decided(i, a.decision)

    def _decided(self, i: int, d: Decision) -> None:
        """kvgate's answer for request ``i``, at once or out of its queue: send it or refuse it."""
        if d.admitted:
            assert d.lease is not None and d.lease.node is not None
            self._send(i, self._by_address[d.lease.node], d.lease.ticket)
            self._decisions.append((self.now, "admitted", self.outcomes[i].req.tenant))
            if d.lease.slo_miss:
                self._decisions.append((self.now, "slo_miss", self.outcomes[i].req.tenant))
        else:
            assert d.rejection is not None
            self._reject(i, d.rejection.status, d.rejection.reason, d.rejection.klass)
            if d.rejection.fleet_caused:
                self._decisions.append((self.now, "fleet", self.outcomes[i].req.tenant))

    def _step_end(self, n: SimNode) -> None:
        n.busy = False
        events = n.engine.end_step(self.now)
        done = False
        for ev in events:
            if not ev.finished:
                continue
            req = ev.request
            i, ticket = self._inflight.pop(req)
            o = self.outcomes[i]
            assert req.first_token is not None and req.finished_at is not None
            o.ttft, o.e2e = req.first_token - o.req.t, req.finished_at - o.req.t
            n.observe("e2e", req.finished_at - req.arrival)
            n.observe("request_prompt", float(req.prompt_tokens))
            n.observe("ttft", req.first_token - req.arrival)
            if req.first_scheduled is not None:
                n.observe("queue", req.first_scheduled - req.arrival)
                if req.prefill_done_at is not None:
                    n.observe("prefill", req.prefill_done_at - req.first_scheduled)
            if self.core is not None and ticket is not None:
                self.core.ended(Ended(ticket, f"r{i}", 200, Usage(req.prompt_tokens, req.output_tokens),
                                      upstream_answered=True))
                done = True
        self._kick(n)
        self._maybe_gone(n)
        if done:
            self._answers()

    def _tick(self) -> None:
        if self.core is not None:
            poll = self.config.nodes.poll_interval_seconds if self.config.nodes else 0.25
            if self._next_poll <= self.now + 1e-9:
                for n in self.nodes:
                    if n.state == "ready":
                        self._probe(n)
                self._next_poll = self.now + poll
            self.core.tick()
            self._answers()

    def _scale(self) -> None:
        ready = [n for n in self.nodes if n.state == "ready"]
        provisioned = sum(1 for n in self.nodes if n.state in ("loading", "ready"))
        p = self.policy
        if p.autoscale == "queue":
            waiting = sum(n.engine.scheduler.num_waiting for n in ready)
            want = max(p.min_nodes, min(p.max_nodes, math.ceil(waiting / self.auto.waiting_per_node)))
            self._desired_history.append((self.now, want))
            while self._desired_history and self._desired_history[0][0] < self.now - self.auto.scale_down_window_s:
                self._desired_history.popleft()
            if want > provisioned:  # the HPA's default scale-up limit: 4 pods or 100% per period
                target = min(want, provisioned + max(4, provisioned))
            else:  # scale down only to the highest recommendation of the stabilisation window
                target = max(w for _, w in self._desired_history)
        else:
            assert self.law is not None and self.core is not None
            horizon = self.now - self.auto.window_s
            while self._decisions and self._decisions[0][0] < horizon:
                self._decisions.popleft()
            by: dict[str, dict[str, float]] = {k: {} for k in KINDS}
            for _, kind, tenant in self._decisions:
                by[kind][tenant] = by[kind].get(tenant, 0.0) + 1
            kv = [n.engine.scheduler.kv_usage for n in ready]  # what kvgate_node_kv_usage_ratio reports
            sig = Signals(self.now, by["admitted"], by["capacity"], by["policy"], float(self.core.queued),
                          len(ready), True, fleet_caused=by["fleet"], budget_rejected=by["budget"],
                          slo_missed=by["slo_miss"], kv_usage=sum(kv) / len(kv) if kv else None)
            target = self.law.decide(sig, self.now).desired
        if target > provisioned:
            for _ in range(target - provisioned):
                self._provision()
        elif target < provisioned:
            self._retire(provisioned - target)

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> RunResult:
        arrivals = self.trace
        k = 0
        start = arrivals[0].t if arrivals else 0.0
        self.now = start
        self._next_poll = start
        self._push(start, "tick")
        if self.policy.autoscale != "none":
            self._push(start + self.auto.interval_s, "scale")
        for d in self.degrade:
            self._push(d.at, "degrade", d)
        end_of_trace = arrivals[-1].t if arrivals else start
        while True:
            nxt = arrivals[k].t if k < len(arrivals) else math.inf
            if self._events and self._events[0][0] <= nxt:
                t, _, kind, arg = heapq.heappop(self._events)
                self.now = t
                if kind == "step":
                    self._step_end(arg)
                elif kind == "tick":
                    self._tick()
                    if self._busy() or k < len(arrivals):
                        self._push(t + PUMP_INTERVAL_S, "tick")
                elif kind == "scale":
                    self._scale()
                    if t < end_of_trace or self._busy():
                        self._push(t + self.auto.interval_s, "scale")
                elif kind == "ready":
                    self._ready(arg)
                elif kind == "degrade" and arg.node < len(self.nodes):
                    self.nodes[arg.node].engine.profile = _slowed(self.profile, arg.factor)
                continue
            if nxt == math.inf:
                break
            self.now = nxt
            self._arrive(k)
            k += 1
        last = max([o.decided_at or 0.0 for o in self.outcomes] + [
            (o.req.t + o.e2e) for o in self.outcomes if o.e2e is not None] + [start])
        for n in self.nodes:  # what is still up is billed until the run's end, not a later autoscaler tick
            if n.state != "gone":
                n.stopped_at = last
        gpus = self._gpus()
        gpu_s = sum(min(n.stopped_at or last, last) - n.provisioned_at for n in self.nodes)
        lost = sum(1 for o in self.outcomes if o.status == 0 or (o.status == 200 and o.e2e is None))
        computed = sum(n.engine.scheduler.prefix_queries + n.engine.scheduler.preempted_prefix_queries
                       - n.engine.scheduler.prefix_hits - n.engine.scheduler.preempted_prefix_hits for n in self.nodes)
        return RunResult(self.policy, self.outcomes, last - start, gpu_s * gpus, gpus, self.node_timeline,
                         self.breaker_opens, lost, dict(self.breaker_opens_by_cause), computed)

    def _busy(self) -> bool:
        return bool(self._inflight or self._held)

    def _gpus(self) -> int:
        name = self.profile.name
        return int(name.rsplit("x", 1)[1]) if "x" in name.rsplit("-", 1)[-1] else 1


def simulate(config: Config, policy: Policy, profile: Profile, trace: list[TraceRequest], seed: int = 0,
             **kw: Any) -> RunResult:
    return Run(config, policy, profile, trace, seed, **kw).run()

