"""The starvation guard's owed release against the one-level readiness hold, as a hostile batch tenant
(attack14)."""

from __future__ import annotations

import random

from ext_proc.admission import Usage
from ext_proc.core import Answer, Ended, Request
from ext_proc.estimate import Estimate
from gpu_probe.snapshot import Snapshot
from tests.helpers import PAIR, FakeClock, pair_core


class FakePair:
    """A core over the two nodes of ``PAIR`` (one vLLM level) and a stand-in vLLM behind it: a request ends
    ``tail`` s after its prefill (20 µs a prompt token), dispatched at once; a reading every 100 ms shows
    what runs and nothing waiting."""

    def __init__(self, tail: float, output: int, **tiers: str) -> None:
        self.clock = FakeClock()
        self.core = pair_core(self.clock, **tiers)
        self.tail, self.output = tail, output
        self.running: dict[str, tuple[float, str, int]] = {}
        self.reading()

    def reading(self) -> None:
        for a in PAIR:
            n = sum(1 for _, node, _ in self.running.values() if node == a)
            self.core.snapshot(a, Snapshot(node="n", at=self.clock(), ok=True, kv_usage=0.3, blocks_total=100_000,
                                           block_size=16, running=float(n), waiting=0.0))

    def ask(self, request_id: str, key: str, prompt: int) -> Answer | None:
        a = self.core.decide(Request("/v1/chat/completions", request_id, f"Bearer {key}",
                                     estimate=Estimate(prompt, self.output, parsed=True), body_bytes=10))
        return a if isinstance(a, Answer) else None

    def start(self, a: Answer, prompt: int) -> bool:
        """Run an admitted answer's request; whether it was admitted."""
        d = a.decision
        if not (d.admitted and d.lease is not None):
            return False
        self.running[d.lease.ticket] = (self.clock() + prompt * 2e-5 + self.tail, d.lease.node or "", prompt)
        return True

    def step(self, k: int) -> None:
        """The end of tick ``k``: requests that ended end, a reading every tenth, the core's tick."""
        for t, (end, _, p) in list(self.running.items()):
            if end <= self.clock():
                del self.running[t]
                self.core.ended(Ended(t, "x", 200, Usage(p, self.output), upstream_answered=True))
        if k % 10 == 0:
            self.reading()
        self.core.tick()


def mixed_load(seconds: float = 30.0) -> tuple[int, int, int]:
    """One vLLM level (kvgate writes no priorities), two nodes; an interactive tenant sends 1,500-token
    prompts (Poisson, one per 20 ms on average) and a batch tenant keeps about 20 requests of 2,000 tokens
    queued; each request ends its prefill + 0.75 s after dispatch. (interactive admitted, of them predicted
    past the 200 ms target, batch admitted)."""
    sim = FakePair(0.75, 50, i="interactive", b="batch")
    core = sim.core
    rng = random.Random(1)
    admitted = {"i": 0, "b": 0}
    missed = 0

    def handle(a: Answer | None, prompt: int) -> None:
        nonlocal missed
        if a is not None and sim.start(a, prompt):
            who = a.request_id[0]
            admitted[who] += 1
            assert a.decision.lease is not None
            missed += who == "i" and a.decision.lease.slo_miss

    batch = 0
    for k in range(int(seconds / 0.01)):
        sim.clock.advance(0.01)
        if rng.random() < 0.5:
            handle(sim.ask(f"i{k}", "i", 1_500), 1_500)
        if core.queued < 20 and k % 5 == 0:
            batch += 1
            handle(sim.ask(f"b{batch}", "b", 2_000), 2_000)
        for a in core.answers():
            handle(a, 2_000 if a.request_id[0] == "b" else 1_500)
        sim.step(k)
    return admitted["i"], missed, admitted["b"]


def test_the_owed_release_does_not_become_a_steady_channel_past_the_readiness_hold() -> None:
    """attack14 B1: a release that skipped the hold every time it was owed (db9aaaa) was a steady channel
    past it: 110 of batch's 193 releases in 30 s, interactive's predicted misses 39% against 14% with owed
    releases held. Now an owed release skips the hold only when no node has been ready for the top tier for
    ``OWED_HOLD_S``: 18%, batch still served (163)."""
    interactive, missed, batch = mixed_load()
    assert batch > 100  # batch is served (with the hold kept for owed releases: 161)
    assert missed <= 0.2 * interactive


def tiny_top_stream(seconds: float = 10.0) -> tuple[int, int]:
    """review17 F0: one vLLM level, two nodes; an interactive tenant sends a 100-token request every 10 ms,
    a standard tenant 8,000-token prompts (Poisson, 5/s); each ends its prefill + 0.3 s after dispatch.
    (standard admitted, standard refused)."""
    sim = FakePair(0.3, 10, i="interactive", s="standard")
    rng = random.Random(1)
    got = {"ok": 0, "refused": 0}

    def handle(a: Answer | None, prompt: int) -> None:
        if a is None:
            return
        if sim.start(a, prompt):
            got["ok"] += a.request_id[0] == "s"
        elif not a.decision.queued and a.request_id[0] == "s":
            got["refused"] += 1

    for k in range(int(seconds / 0.01)):
        sim.clock.advance(0.01)
        handle(sim.ask(f"i{k}", "i", 100), 100)
        if rng.random() < 0.05:
            handle(sim.ask(f"s{k}", "s", 8_000), 8_000)
        for a in sim.core.answers():
            handle(a, 8_000 if a.request_id[0] == "s" else 100)
        sim.step(k)
    return got["ok"], got["refused"]


def test_a_stream_of_tiny_top_tier_requests_does_not_lock_out_long_lower_tier_prompts() -> None:
    """review17 F0: under the one-level step-share rule (``Picker._late_beside``) every node always had a
    top-tier request waiting for its first token, and a prompt held for it waited for each new one: 0 of
    54 of standard's prompts served (each 503 queue-deadline), 54 without the rule. The rule now only
    steers a prompt to another ready node, never holds it: 54 served."""
    ok, refused = tiny_top_stream()
    assert ok >= 2 * refused
