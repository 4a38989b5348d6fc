"""kvgate's node choice (``Fleet``) in front of simulated vLLM engines, in virtual time: what the
performance model predicts against what the engine then does.

The probe path is the production one: each node's readings (as ``kvgate/bench/scenarios/driver.py``'s
``SimNode.reading`` makes them) go through ``gpu_probe.snapshot.Deriver`` into ``Fleet.on_snapshot``
every ``PROBE_S``. Requests are placed with ``Fleet.place`` and run on the chosen node's engine; the
prediction kvgate made at dispatch is kept beside the request, whose realised first token the engine
fills in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from ext_proc.config import parse_config
from ext_proc.nodes import Fleet
from ext_proc.profiles import Profile, get_profile
from gpu_probe.parse import EngineReading
from gpu_probe.snapshot import Deriver, Snapshot
from sim.engine import Engine, EngineOptions
from sim.scheduler import Policy, Request

PROBE_S = 0.5
"""As ``kvgate probe --interval``'s default (and the scenario driver's)."""


def slowed(p: Profile, factor: float) -> Profile:
    """The profile with every step-time coefficient ``factor`` x (the scenarios' degraded node)."""
    return replace(p, a_ms=p.a_ms * factor, b_ms_per_prefill_token=p.b_ms_per_prefill_token * factor,
                   c_ms_per_decode_seq=p.c_ms_per_decode_seq * factor,
                   d_ms_per_context_token=p.d_ms_per_context_token * factor)


@dataclass
class Sent:
    """One request kvgate placed: where, what it predicted, and the engine's request (realised timings)."""

    node: int
    predicted: float | None
    req: Request

    @property
    def realised(self) -> float | None:
        return None if self.req.first_token is None else self.req.first_token - self.req.arrival


@dataclass
class Bench:
    """``nodes`` simulated engines of ``profile`` (node i slowed by ``slow[i]``), kvgate's fleet with that
    profile as its prior (``nodes.performance``)."""

    profile: str
    nodes: int = 1
    slow: dict[int, float] = field(default_factory=dict)
    seed: int = 1
    nodes_config: dict[str, object] = field(default_factory=dict)
    policy: Policy = "fcfs"
    """The engines' scheduling policy (``priority``: vLLM's ``--scheduling-policy priority``)."""

    def __post_init__(self) -> None:
        cfg = parse_config({"nodes": {
            "static": [{"address": self.address(i), "probe": f"http://p{i}"} for i in range(self.nodes)],
            "performance": {"profile": self.profile}, **self.nodes_config}})
        assert cfg.nodes is not None
        self.fleet = Fleet(cfg.nodes, random.Random(self.seed))
        base = get_profile(self.profile)
        self.engines: list[Engine] = []
        for i in range(self.nodes):
            prof = slowed(base, self.slow[i]) if i in self.slow else base
            e = Engine(prof, EngineOptions(policy=self.policy, seed=self.seed + i))
            e.every_token = False
            self.engines.append(e)
        self.derivers = [Deriver(self.address(i)) for i in range(self.nodes)]
        self.busy: list[float | None] = [None] * self.nodes
        """When each engine's step in progress ends (None: idle)."""
        self.now = 0.0
        self.next_probe = 0.0
        self.sent: list[Sent] = []
        self.tickets: dict[Request, str] = {}
        self.factors: list[list[float]] = [[] for _ in range(self.nodes)]
        """Each node's speed factor after every reading."""
        self.snaps: list[list[Snapshot]] = [[] for _ in range(self.nodes)]
        self._n = 0

    @staticmethod
    def address(i: int) -> str:
        return f"node-{i}:8000"

    def reading(self, i: int) -> EngineReading:
        e = self.engines[i]
        s = e.scheduler
        return EngineReading(e.profile.model_name, "0", kv_usage=s.kv_usage, kv_metric="vllm:kv_cache_usage_perc",
                             running=float(len(s.running)), waiting=float(s.num_waiting),
                             counters={"preemptions": float(s.preemptions),
                                       "generation_tokens": float(s.generation_tokens)},
                             hist={"itl": (e.itl_sum, float(e.itl_count)),
                                   "iteration": (float(e.step_tokens), float(e.steps))},
                             num_gpu_blocks=s.cfg.num_gpu_blocks, block_size=s.cfg.block_size)

    def probe(self) -> None:
        for i in range(self.nodes):
            snap = self.derivers[i].update({(self.engines[i].profile.model_name, "0"): self.reading(i)}, self.now)
            self.fleet.on_snapshot(self.address(i), snap, self.now)
            self.factors[i].append(self.fleet.nodes[self.address(i)].speed.factor)
            self.snaps[i].append(snap)

    def kick(self, i: int) -> None:
        if self.busy[i] is None:
            dt = self.engines[i].begin_step(self.now)
            self.busy[i] = None if dt is None else self.now + dt

    def send(self, prompt: int, output: int, node: int | None = None, priority: int = 0, *,
             urgent: bool | None = None, target: float | None = None, limit: float | None = None) -> Sent | None:
        """Place a request now (``node``: on that node, with the fleet's prediction for it) and start it;
        ``priority``: the vLLM priority written into its body (and the level kvgate books it at);
        ``urgent``, ``target``, ``limit``: as ``Fleet.place`` takes them (its tier's)."""
        self._n += 1
        ticket = f"t{self._n}"
        if node is None:
            c = self.fleet.place(prompt + output, prompt, ticket, self.now, priority=priority, target=target,
                                 limit=limit, urgent=urgent)
            if c.node is None:
                return None
            i, predicted = int(c.node.address.split("-")[1].split(":")[0]), c.ttft
        else:
            i = node
            predicted = self.fleet.predict(self.fleet.nodes[self.address(i)], prompt, priority, self.now)
            self.fleet.dispatched(self.address(i), ticket, prompt + output, prompt, self.now, priority, predicted)
        req = Request(ticket, prompt, output, self.now, priority)
        self.engines[i].add(req)
        self.tickets[req] = ticket
        s = Sent(i, predicted, req)
        self.sent.append(s)
        self.kick(i)
        return s

    def advance(self, until: float) -> None:
        """Run steps and probe readings up to ``until``."""
        while True:
            ends = [(t, i) for i, t in enumerate(self.busy) if t is not None]
            step_t, step_i = min(ends) if ends else (math.inf, -1)
            t = min(step_t, self.next_probe)
            if t > until:
                break
            self.now = t
            if step_t <= self.next_probe:
                self.busy[step_i] = None
                for ev in self.engines[step_i].end_step(self.now):
                    if ev.finished:
                        r = ev.request
                        self.fleet.completed(self.address(step_i), self.tickets.pop(r), r.prompt_tokens
                                             + r.output_tokens, True, self.now)
                self.kick(step_i)
            else:
                self.probe()
                self.next_probe = self.now + PROBE_S
        self.now = until

    def run(self, arrivals: list[tuple[float, int, int]]) -> None:
        """Play ``arrivals`` ((time, prompt, output), sorted), each placed by the fleet, then drain."""
        for t, prompt, output in arrivals:
            self.advance(t)
            self.send(prompt, output)
        self.drain()

    def drain(self, limit: float = 600.0) -> None:
        end = self.now + limit
        while any(b is not None for b in self.busy) and self.now < end:
            nxt = min(b for b in self.busy if b is not None)
            self.advance(max(nxt, self.now))


def poisson(rate: float, duration: float, seed: int, mix: list[tuple[float, tuple[int, int], tuple[int, int]]]
            ) -> list[tuple[float, int, int]]:
    """Poisson arrivals at ``rate``/s for ``duration`` s; each drawn from ``mix``: (share, prompt range,
    output range), sizes uniform in their ranges."""
    rng = random.Random(seed)
    out: list[tuple[float, int, int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        x = rng.random()
        pick = mix[-1]
        for m in mix:
            if x < m[0]:
                pick = m
                break
            x -= m[0]
        _, (p0, p1), (o0, o1) = pick
        out.append((t, rng.randint(p0, p1), rng.randint(o0, o1)))


def capacity(profile: str, mix: list[tuple[float, tuple[int, int], tuple[int, int]]]) -> float:
    """Requests/s one node of ``profile`` serves of ``mix`` at saturation, from the profile's step-time
    model (as ``kvgate.bench.scenarios.families.node_capacity_rps`` reckons it): every request costs its
    prefill, its decode slots and the context it attends while decoding; the fixed cost of a step is
    shared by as large a batch as the KV cache holds."""
    p = get_profile(profile)
    ep = eo = eoc = 0.0
    for share, (p0, p1), (o0, o1) in mix:
        prompt, output = (p0 + p1) / 2, (o0 + o1) / 2
        ep, eo, eoc = ep + share * prompt, eo + share * output, eoc + share * output * (prompt + output / 2)
    work_ms = p.b_ms_per_prefill_token * ep + p.c_ms_per_decode_seq * eo + p.d_ms_per_context_token * eoc
    batch = min(float(p.max_num_seqs), p.kv_tokens / (eoc / eo))
    return 1000.0 / (work_ms + p.a_ms * eo / batch)
