"""The per-node performance model (``ext_proc/perf.py``) and what is built on it: TTFT predictions
against the simulated engine in virtual time, the learned speed factor, the model-relative breaker,
the probe's step figures, its config, and the fleet-caused 429.

Everything runs in virtual time with fixed seeds: no wall-clock threshold anywhere.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from ext_proc.admission import Admission, Usage
from ext_proc.breaker import State
from ext_proc.config import ConfigError, Performance, parse_config
from ext_proc.core import Core, Held, Request, null_logger
from ext_proc.estimate import Estimate
from ext_proc.identity import hash_key
from ext_proc.nodebook import Node
from ext_proc.nodes import Fleet
from ext_proc.perf import FLOOR_SLACK, MAX_FACTOR, MIN_FACTOR, Speed, StepModel, from_config, step_floor, step_ratio
from ext_proc.picker import READY_SHARE
from ext_proc.profiles import get_profile
from gpu_probe.parse import parse
from gpu_probe.snapshot import Deriver, Snapshot
from kvgate.bench.scenarios.driver import Degrade, Policy, Run, simulate
from kvgate.bench.scenarios.workloads import LONG, SHORT, Stream, const, poisson
from sim.engine import Engine, EngineOptions
from sim.metrics import NodeMetrics
from sim.scheduler import Request as SimRequest
from tests.helpers import FakeClock
from tests.perf_harness import Bench, Sent, capacity
from tests.perf_harness import poisson as arrivals

REFERENCE = Path(__file__).resolve().parent / "fixtures" / "vllm-metrics-sample.txt"

MIX = [(0.8, (100, 600), (40, 200)), (0.2, (2000, 6000), (100, 400))]
"""80% chat-sized requests, 20% RAG-sized ones (prompt and output ranges)."""


# -- a. predicted TTFT against the simulator -----------------------------------------------------------


@pytest.mark.parametrize("profile", ["8b-h100", "34b-a100"])
@pytest.mark.parametrize("prompt", [40, 300, 2000, 7000])
def test_a_lone_request_on_an_idle_node_gets_its_first_token_when_predicted(profile: str, prompt: int) -> None:
    b = Bench(profile)
    b.advance(1.0)  # the probe has read the idle node
    sent = b.send(prompt, 16, node=0)
    assert sent is not None and sent.predicted is not None
    b.drain()
    assert sent.realised is not None
    # 7000 tokens on an a100 budget of 2048 are 4 chunked steps: the prediction counts them
    assert sent.predicted == pytest.approx(sent.realised, rel=0.10)


@pytest.mark.parametrize(("profile", "seconds"), [("8b-h100", 60.0), ("34b-a100", 240.0)])
def test_under_a_steady_mixed_load_predictions_track_the_realised_ttft(profile: str, seconds: float) -> None:
    """Poisson arrivals of short and long prompts at ~65% of two nodes' capacity, each placed by
    ``Fleet.place`` (which predicts every candidate) and run on the engine it chose."""
    b = Bench(profile, nodes=2, seed=4)
    b.run(arrivals(0.65 * capacity(profile, MIX) * 2, seconds, 4, MIX))
    done = [s for s in b.sent if s.realised is not None and s.predicted is not None]
    assert len(done) == len(b.sent) > 200
    assert {s.node for s in done} == {0, 1}
    m = b.fleet.model
    behind = [s for s in done if s.realised > 1.3 * m.prefill(s.req.prompt_tokens, 0, 0)]  # type: ignore[operator]
    assert len(behind) > 0.05 * len(done)  # a load where requests do wait behind others
    errors = [abs(s.predicted - s.realised) / s.realised for s in done]  # type: ignore[operator]
    assert statistics.median(errors) < 0.25
    bias = statistics.median(s.predicted / s.realised for s in done)  # type: ignore[operator]
    assert 0.8 < bias < 1.2


def test_requests_behind_a_running_chunked_prefill_are_predicted_too() -> None:
    b = Bench("34b-a100", nodes=2, seed=4)
    b.run(arrivals(0.65 * capacity("34b-a100", MIX) * 2, 240.0, 4, MIX))
    m = b.fleet.model
    behind = [s for s in b.sent if s.realised is not None and s.predicted is not None
              and s.realised > 1.5 * m.prefill(s.req.prompt_tokens, 0, 0)]
    assert len(behind) > 20
    errors = [abs(s.predicted - s.realised) / s.realised for s in behind]  # type: ignore[operator]
    assert statistics.median(errors) < 0.25


def _one_node(profile: str = "8b-h100") -> tuple[Fleet, Any]:
    cfg = parse_config({"nodes": {"static": [{"address": "a:1", "probe": "http://p"}],
                                  "performance": {"profile": profile}}})
    assert cfg.nodes is not None
    f = Fleet(cfg.nodes, random.Random(1))
    f.on_snapshot("a:1", Snapshot(node="n", at=0, ok=True, kv_usage=0.0, blocks_total=100_000, block_size=16,
                                  running=0, waiting=0), 0.0)
    return f, f.nodes["a:1"]


def test_no_node_within_the_limit_is_a_fleet_queue_answer_with_the_predicted_wait() -> None:
    f, n = _one_node()
    for i in range(10):  # ~1.7 s of prefill booked (8b-h100: ~0.17 s each)
        assert f.place(8200, 8000, f"b{i}", 0.0).node is n
    soonest = f.predict(n, 100, 0, 0.0)
    assert 1.5 < soonest < 2.5
    c = f.choose(200, 0.0, prompt_tokens=100, target=0.5, limit=1.0)
    assert (c.node, c.reason) == (None, "fleet-queue")
    assert c.ttft == pytest.approx(soonest) and c.retry_after == pytest.approx(soonest - 0.5)
    late = f.choose(200, 0.0, prompt_tokens=100, target=0.5, limit=5.0)  # its target lost, its max wait not
    assert late.node is n and late.ttft == pytest.approx(soonest)
    assert f.choose(200, 0.0, prompt_tokens=100).node is n  # no target: the soonest node, whatever it says


def test_while_the_top_tier_is_active_a_lower_tier_arrival_goes_only_within_its_target() -> None:
    """A new request of a tier below the top goes at once within its max wait, its target lost — but not
    while the top tier has traffic (a request of it within ``TOP_RECENT_S``) and the gateway queue puts
    tiers in order (``urgent`` False): sent late it would take the place of requests that can still make
    their targets, so it is refused with the predicted wait, as a held request is. Without the gateway
    queue (``urgent`` None: kv-shed's rule) it still goes within its max wait, and so it does again once
    the top tier has been quiet for ``TOP_RECENT_S``."""
    from ext_proc.nodes import Level
    from ext_proc.picker import TOP_RECENT_S

    def book(f: Fleet, at: float) -> None:
        for i in range(10):  # ~1.7 s of less urgent prefill booked
            assert f.place(8200, 8000, f"b{at}-{i}", at, priority=1, urgent=False).node is n

    f, n = _one_node()
    f.set_levels([Level(0, 0.2), Level(1, 0.5)])
    book(f, 0.0)
    args = {"prompt_tokens": 100, "priority": 1, "target": 0.5, "limit": 5.0}
    assert f.choose(200, 0.0, urgent=False, **args).node is n  # the top tier quiet: late, within its max wait
    f.choose(116, 0.0, prompt_tokens=100, target=0.2, limit=1.0, urgent=True)  # the top tier has traffic
    soonest = f.predict(n, 100, 1, 0.0)
    late = f.choose(200, 0.0, urgent=False, **args)
    assert (late.node, late.reason) == (None, "fleet-queue")
    assert late.ttft == pytest.approx(soonest) and late.retry_after == pytest.approx(soonest - 0.5)
    assert f.choose(200, 0.0, urgent=None, **args).node is n  # no gateway queue: a lower level, as before
    later = TOP_RECENT_S + 0.5  # the top tier quiet again (a fresh reading, the same backlog booked)
    f.on_snapshot("a:1", Snapshot(node="n", at=later, ok=True, kv_usage=0.0, blocks_total=100_000, block_size=16,
                                  running=0, waiting=0), later)
    book(f, later)
    assert f.predict(n, 100, 1, later) > 0.5
    assert f.choose(200, later, urgent=False, **args).node is n


def test_a_lower_tier_arrival_held_to_its_target_is_still_bound_by_its_max_wait() -> None:
    """review68 M1: a prompt whose own prefill alone is longer than its target is refused only for the work
    ahead of it — read against the target alone, one whose prefill nearly fills its max wait went past it
    (a 67,000-token standard prompt on a 70B node: predicted 5.08 s against its 5 s max wait). Held to its
    target, it still never goes past its max wait."""
    from ext_proc.nodes import Level

    f, n = _one_node("70b-h100x4")
    f.set_levels([Level(0, 0.2)])
    f.booked_elsewhere("a:1", 8200, 8000, 0, 0.0)
    p = 67_000
    assert f.predict(n, p, 0, 0.0) - f.predict(n, 0, 0, 0.0) > 4.5 and f.predict(n, p, 0, 0.0) > 5.0
    f.choose(116, 0.0, prompt_tokens=100, target=0.2, limit=1.0, urgent=True)
    c = f.choose(p + 200, 0.0, prompt_tokens=p, target=1.0, limit=5.0, urgent=False)
    assert (c.node, c.reason) == (None, "fleet-queue")


def test_a_long_lower_tier_arrival_held_to_its_target_goes_within_its_max_wait_not_to_the_fullest_node() -> None:
    """review68 H1: with several vLLM levels a long prompt goes to the fullest node that meets its target,
    else its max wait. A new arrival held to its target read the second as its target too: a prompt whose
    own prefill alone is longer than its target met neither, and best fit took the fullest node of all,
    an 11.4 s first token where the other node gave 0.53 s. The hold decides whether it goes, not where."""
    from ext_proc.nodes import Level

    cfg = parse_config({"nodes": {"static": [{"address": "a:1", "probe": "http://p"},
                                             {"address": "b:1", "probe": "http://q"}],
                                  "performance": {"profile": "8b-h100"}}})
    assert cfg.nodes is not None
    f = Fleet(cfg.nodes, random.Random(1))
    for a in ("a:1", "b:1"):
        f.on_snapshot(a, Snapshot(node=a, at=0, ok=True, kv_usage=0.0, blocks_total=100_000, block_size=16,
                                  running=0, waiting=0), 0.0)
    f.set_levels([Level(0, 0.2), Level(1, 0.3)])
    for _ in range(60):
        f.booked_elsewhere("a:1", 8200, 8000, 1, 0.0)
    f.booked_elsewhere("b:1", 2200, 2000, 1, 0.0)
    p = 23_000
    full, quick = f.predict(f.nodes["a:1"], p, 1, 0.0), f.predict(f.nodes["b:1"], p, 1, 0.0)
    assert full > 5.0 and quick < 1.0
    f.choose(116, 0.0, prompt_tokens=100, priority=0, target=0.2, limit=1.0, urgent=True)
    for limit in (5.0, 0.3):  # a new arrival held to its target; one held in the gateway queue (review69 M2)
        c = f.choose(p + 200, 0.0, prompt_tokens=p, priority=1, target=0.3, limit=limit, urgent=False)
        assert c.node is f.nodes["b:1"] and c.ttft == pytest.approx(quick)


def test_a_long_prompt_refused_for_the_work_ahead_is_told_when_that_work_fits() -> None:
    """review69 L1: a new arrival whose own prefill alone is longer than its target, held to that target
    (a lower tier while the top tier is active), is refused only for the work ahead of it, and its
    Retry-After is when that work is down to its target — not when its whole first token would be (too
    long by the prefill itself); coming back then, it goes. A request held in the gateway queue (its limit
    what is left of its target) is told when its first token would be within that (review70 M1: its retry
    has its whole target again, so that is too long, never too short)."""
    from ext_proc.nodes import Level

    f, n = _one_node()
    f.set_levels([Level(0, 0.05)])
    for i in range(10):  # ~1.7 s of less urgent prefill booked
        f.place(8200, 8000, f"b{i}", 0.0, urgent=False)
    f.choose(116, 0.0, prompt_tokens=100, target=0.05, limit=1.0, urgent=True)  # the top tier has traffic
    own = f.predict(n, 8000, 0, 0.0) - f.predict(n, 0, 0, 0.0)
    assert own > 0.1
    c = f.choose(8200, 0.0, prompt_tokens=8000, target=0.1, limit=5.0, urgent=False)
    assert (c.node, c.reason) == (None, "fleet-queue") and c.ttft is not None and c.retry_after is not None
    assert c.retry_after == pytest.approx(c.ttft - own - 0.1, abs=0.02)
    held = f.choose(8200, 0.0, prompt_tokens=8000, target=0.1, limit=0.1, urgent=False)
    assert held.retry_after == pytest.approx(c.ttft - 0.1)
    later = c.retry_after + 0.02
    f.choose(116, later, prompt_tokens=100, target=0.05, limit=1.0, urgent=True)
    assert f.choose(8200, later, prompt_tokens=8000, target=0.1, limit=5.0, urgent=False).node is n


def test_the_top_tier_is_predicted_ahead_of_less_urgent_backlog() -> None:
    from ext_proc.nodes import Level

    f, n = _one_node()
    f.set_levels([Level(1, 2.0), Level(0, 0.5), Level(0, 0.3), Level(2, None)])
    assert [(lv.priority, lv.target) for lv in f.levels] == [(0, 0.3), (1, 2.0), (2, None)]
    for i in range(6):
        f.place(8200, 8000, f"low{i}", 0.0, priority=2)
    top, low = f.predict(n, 200, 0, 0.0), f.predict(n, 200, 2, 0.0)
    assert low > 1.0 and top < low / 3  # vLLM's priority queue runs it first: at most the chunk running
    f.place(300, 200, "top", 0.0, priority=0)
    assert f.predict(n, 200, 2, 0.0) > low  # and the less urgent wait behind it


def test_the_top_tier_waits_for_every_less_urgent_prefill_vllm_already_runs() -> None:
    """vLLM (priority policy) admits a waiting request into any step with budget left: two long standard
    prompts sent together both run from the first step (6,000 + 2,192 of 8,192), and an interactive one
    arriving after cannot start before the running ones leave budget — it waits for both, not for the
    first only (kvgate predicted ~0.09 s for a ~0.21 s wait: issue 30's late short interactive prompts)."""
    from ext_proc.nodes import Level

    b = Bench("8b-h100", policy="priority")
    b.fleet.set_levels([Level(0, 0.2), Level(1, 1.0)])
    b.advance(1.0)  # the probe has read the idle node
    for _ in range(2):
        b.send(6000, 16, node=0, priority=1)
    b.advance(1.05)
    top = b.send(200, 16, node=0, priority=0)
    assert top is not None and top.predicted is not None
    b.drain()
    assert top.realised is not None and top.realised > 0.15
    assert top.predicted == pytest.approx(top.realised, rel=0.25)


def test_with_one_vllm_level_less_urgent_prompts_leave_the_top_tier_a_ready_node() -> None:
    """kvgate writes no priorities (the default): vLLM is first come, first served, and every tier books
    at level 0. A long standard prompt still goes while another node stays ready for the top tier, but
    not to the last ready node: it is held (``fleet-queue`` with no prediction: the gateway queue keeps
    it), and an interactive request arriving next gets its first token within its target there
    (bursty-mmpp seed 1: long standard and batch prompts filled all four nodes' queues and 10 of the
    interactive tenant's 34 requests in that minute were refused)."""
    from ext_proc.nodes import Level

    b = Bench("8b-h100", nodes=2)
    b.fleet.set_levels([Level(0, 0.2)])
    b.advance(1.0)
    assert b.send(100, 16, urgent=True, target=0.2, limit=1.0) is not None  # the top tier has traffic
    b.advance(1.5)
    first = b.send(6000, 16, urgent=False, target=1.0, limit=5.0)
    assert first is not None
    held = b.fleet.place(6016, 6000, "held", b.now, target=1.0, limit=5.0, urgent=False)
    assert (held.node, held.reason, held.ttft) == (None, "fleet-queue", None)
    top = b.send(200, 16, urgent=True, target=0.2, limit=1.0)
    assert top is not None and top.node != first.node
    b.drain()
    assert top.realised is not None and top.realised <= 0.2
    # a short one still goes to the ready node: it keeps it ready
    assert b.send(100, 16, urgent=False, target=1.0, limit=5.0) is not None


def slow_pair_and_busy_fast_node(booked: int) -> tuple[Bench, list[Node], float]:
    """review11's fleet: two slow ready nodes (speed factor 6: a mixed fleet), each decoding, and one fast
    node with ``booked`` 1,500-token prompts ahead (not ready for the top tier: one vLLM level, 200 ms
    target); the top tier has traffic. (the bench, its nodes, the fast node's prediction for 3,000 tokens)"""
    from ext_proc.nodes import Level

    b = Bench("8b-h100", nodes=3)
    b.fleet.set_levels([Level(0, 0.2)])
    b.advance(1.0)
    ns = [b.fleet.nodes[b.address(i)] for i in range(3)]
    ns[0].speed.factor = ns[1].speed.factor = 6.0
    assert b.send(100, 16, urgent=True, target=0.2, limit=1.0) is not None  # the top tier has traffic
    for _ in range(booked):
        b.send(1500, 16, node=2)
    b.send(300, 200, node=0)
    b.send(300, 200, node=1)
    b.advance(b.now + 0.05)
    assert b.fleet.predict(ns[2], 0, 0, b.now) > READY_SHARE * 0.2  # not ready
    return b, ns, b.fleet.predict(ns[2], 3000, 0, b.now)


def test_with_one_vllm_level_a_node_not_ready_yet_that_meets_the_limit_keeps_a_request_from_its_refusal() -> None:
    """review11: the hold keeps a less urgent request to the nodes ready for the top tier, and the deadline
    check then looked at those alone. Two slow ready nodes and one fast node with top-tier prefill booked
    (not ready): a standard request held in the queue with 0.42 s of its target left was refused
    (``fleet-queue`` with a prediction: dropped, 503 ``queue-deadline``) although the fast node gives it its
    first token in 0.28 s — and with 0.3 s left it went to a slow node predicted at 0.45 s. Either way it
    should wait for that node: it may not take it now, its target does not leave the margin a node this
    far behind needs (its queue counted twice: ``Picker._keep_one_ready``)."""
    b, ns, fast = slow_pair_and_busy_fast_node(8)
    wait = b.fleet.predict(ns[2], 0, 0, b.now)
    assert fast < 0.3 and fast + wait > 0.42  # quick for this one, but not with the margin
    for lim in (0.3, 0.42):
        assert b.fleet.predict(ns[0], 3000, 0, b.now) > lim
        c = b.fleet.choose(3016, b.now, prompt_tokens=3000, target=lim, limit=lim, urgent=False)
        assert (c.node, c.reason, c.ttft) == (None, "fleet-queue", None), (lim, c)


def test_with_one_vllm_level_a_busier_node_that_meets_the_target_with_margin_takes_a_prompt_no_ready_node_can() -> None:
    """No ready node makes the prompt's target (two slow ones) and the fast node, not ready, makes it with
    its queue counted twice (a prediction behind a queue runs late by a share of it: attack52 A1): the
    prompt goes there at once, the ready nodes stay as they are (``Picker._keep_one_ready``) — unless it
    would make a top-tier request waiting there late (review52 F1): then it waits for that node, neither
    refused nor packed beside it."""
    b, ns, fast = slow_pair_and_busy_fast_node(6)
    wait = b.fleet.predict(ns[2], 0, 0, b.now)
    assert fast + wait <= 0.4 < b.fleet.predict(ns[0], 3000, 0, b.now)
    c = b.fleet.choose(3016, b.now, prompt_tokens=3000, target=0.4, limit=0.4, urgent=False)
    assert c.node is ns[2] and c.ttft == pytest.approx(fast)
    c = b.fleet.choose(3016, b.now, prompt_tokens=3000, target=fast + wait - 0.01, limit=0.4, urgent=False)
    assert c.node is None  # without the margin: it waits
    p = b.now + b.fleet.predict(ns[2], 100, 0, b.now)
    ns[2].top_due.append((p, p + 0.001))  # a top-tier request waiting there, 1 ms of slack
    assert b.fleet._late_beside(ns[2], 3000, b.now)
    c = b.fleet.choose(3016, b.now, prompt_tokens=3000, target=0.4, limit=0.4, urgent=False)
    assert (c.node, c.reason, c.ttft) == (None, "fleet-queue", None)


def test_with_one_vllm_level_a_prompt_without_a_target_is_not_sent_to_a_busier_node() -> None:
    """review52 F2: the route to a node not ready is bounded by the prompt's own TTFT target (its queue
    counted twice); a tier without one has no bound (a prompt went to a node 2 s behind to spare a top-tier
    request 20 ms of slack), so it goes beside the ready nodes' top-tier requests instead (review53 F1)."""
    b, ns, _ = slow_pair_and_busy_fast_node(6)
    for n in ns[:2]:
        p = b.now + b.fleet.predict(n, 100, 0, b.now)
        n.top_due.append((p, p + 0.001))  # a top-tier request waiting on each ready node
        assert b.fleet._late_beside(n, 3000, b.now)
    assert not b.fleet._late_beside(ns[2], 3000, b.now)
    c = b.fleet.choose(3016, b.now, prompt_tokens=3000, target=0.4, limit=0.4, urgent=False)
    assert c.node is ns[2]  # with a target it makes there with the margin: the busier node
    c = b.fleet.choose(3016, b.now, prompt_tokens=3000, target=None, limit=None, urgent=False)
    assert c.node in ns[:2]  # without one: beside them
    c = b.fleet.choose(3016, b.now, prompt_tokens=3000, target=None, limit=5.0, urgent=False)
    assert c.node in ns[:2]  # a limit alone is no target (review53 F2)


def test_with_one_vllm_level_a_request_no_node_can_serve_in_time_is_still_refused_at_once() -> None:
    """review11: the hold answered ``fleet-queue`` without a prediction (wait in the gateway queue)
    before the deadline check ran, so a less urgent request that no node at all can give a first token
    within its limit was queued to its deadline instead of refused at once (docs/concepts/nodes.md:
    "refused at once ... holding it would not help"). Two nodes with 1.2 s of top-tier prefill booked:
    a standard request with 0.5 s left is refused with the prediction, as before the hold."""
    from ext_proc.nodes import Level

    b = Bench("8b-h100", nodes=2)
    b.fleet.set_levels([Level(0, 0.2)])
    b.advance(1.0)
    assert b.send(100, 16, urgent=True, target=0.2, limit=1.0) is not None  # the top tier has traffic
    for i in range(2):
        for _ in range(40):
            b.send(1500, 16, node=i)
    b.advance(b.now + 0.05)
    c = b.fleet.choose(1016, b.now, prompt_tokens=1000, target=0.5, limit=0.5, urgent=False)
    assert (c.node, c.reason) == (None, "fleet-queue")
    assert c.ttft is not None and c.ttft > 1.0


def test_with_several_vllm_levels_the_guards_owed_long_release_still_leaves_a_node_clear() -> None:
    """review14: ``owed`` (the starvation guard's release) lifts the one-level readiness hold only. With
    priorities written into bodies a long, less urgent prefill still joins the long prefills booked where
    it makes its max wait rather than take the last node with none booked: that rule never holds a
    request, so the guard's release goes either way — ``owed`` skipped it too, and the release took the
    last clear node."""
    from ext_proc.nodes import Level

    b = Bench("8b-h100", nodes=2, policy="priority")
    b.fleet.set_levels([Level(0, 0.2), Level(1, 5.0)])
    b.advance(1.0)
    assert b.send(100, 16, priority=0, target=0.2, limit=1.0) is not None  # the top tier has traffic
    b.advance(1.5)
    first = b.send(12000, 16, priority=1, target=5.0, limit=10.0)
    assert first is not None
    for owed in (False, True):
        c = b.fleet.choose(12016, b.now, prompt_tokens=12000, priority=1, target=0.4, limit=10.0, owed=owed)
        assert c.node is not None and c.node.address == b.address(first.node), (owed, c)


@pytest.mark.xfail(strict=True, reason="review11: with one vLLM level, the hold's 'not the last ready node' is judged "
                   "on the decision's sample of 8 candidates, not the fleet; a fleet-wide count of ready nodes "
                   "(kept like Room) would fix it — a cheap change would give the last one away instead")
def test_with_one_vllm_level_a_large_fleet_with_ready_nodes_to_spare_does_not_hold_a_long_prompt() -> None:
    """review11: 40 nodes (a large fleet: a decision predicts a sample of 8), 10 of them ready for the
    top tier, 30 with top-tier prefill booked. A 5,500-token standard prompt (its own prefill, 0.12 s,
    makes a node it goes to not ready) is held in the gateway queue whenever the sample holds one ready
    node — about a third of the decisions — although nine more are ready elsewhere: needless queueing,
    and every such release counts for the scaler as a wait for room (its scale-down gate)."""
    from ext_proc.nodes import Level

    n = 40
    b = Bench("8b-h100", nodes=n)
    b.fleet.set_levels([Level(0, 0.2)])
    b.advance(1.0)
    assert b.send(100, 16, urgent=True, target=0.2, limit=1.0) is not None  # the top tier has traffic
    for i in range(10, n):
        for _ in range(6):
            b.send(1500, 16, node=i)
    b.advance(b.now + 0.01)
    ready = [i for i in range(n) if b.fleet.predict(b.fleet.nodes[b.address(i)], 0, 0, b.now) <= 0.1]
    assert len(ready) == 10
    held = sum(b.fleet.choose(5516, b.now, prompt_tokens=5500, target=1.0, limit=5.0, urgent=False).node is None
               for _ in range(200))
    assert held == 0


def test_the_nodes_long_prefill_token_threshold_is_the_models_chunk() -> None:
    """``nodes.performance.long_prefill_token_threshold``: kvgate's prior chunks a prompt as the node does
    (vLLM caps one request's share of a step at it), so a long prompt's prefill takes more steps."""
    cfg = parse_config({"nodes": {"static": [{"address": "a:1", "probe": "http://p"}],
                                  "performance": {"profile": "8b-h100", "long_prefill_token_threshold": 2048}}})
    assert cfg.nodes is not None
    capped, plain = from_config(cfg.nodes.performance), from_config(Performance(profile="8b-h100"))
    assert (capped.chunk(10), plain.chunk(10)) == (2048, 8182)
    assert capped.prefill(8000, 10, 0) > plain.prefill(8000, 10, 0)
    assert capped.prefill(1000, 10, 0) == plain.prefill(1000, 10, 0)  # a short prompt: one step either way
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        parse_config({"nodes": {"static": [{"address": "a:1", "probe": "http://p"}],
                                "performance": {"long_prefill_token_threshold": -1}}})


# -- b. the speed factor -------------------------------------------------------------------------------


def _fresh_factors(b: Bench, node: int = 0) -> list[float]:
    """The node's speed factor after each reading that had decode steps (a new step-time figure)."""
    return [f for f, s in zip(b.factors[node], b.snaps[node], strict=True) if s.step_fresh]


@pytest.mark.parametrize("profile", ["8b-h100", "34b-a100"])
def test_a_node_six_times_slower_than_its_prior_learns_a_factor_near_6(profile: str) -> None:
    b = Bench(profile, slow={0: 6.0})
    for t, prompt, output in arrivals(0.1 * capacity(profile, MIX), 40.0, 3, MIX):
        b.advance(t)
        b.send(prompt, output, node=0)
    b.advance(40.0)
    learned = _fresh_factors(b)
    assert len(learned) > 20
    assert all(5.0 <= f <= 7.0 for f in learned[6:]), learned[:12]  # within a few readings, and it stays


@pytest.mark.parametrize("profile", ["8b-h100", "34b-a100"])
def test_a_healthy_busy_node_with_big_mixed_batches_keeps_its_factor_near_1(profile: str) -> None:
    b = Bench(profile)
    for t, prompt, output in arrivals(0.8 * capacity(profile, MIX), 60.0, 5, MIX):
        b.advance(t)
        b.send(prompt, output, node=0)
    b.advance(60.0)
    snaps = [s for s in b.snaps[0] if s.step_fresh]
    # big batches, prefill chunks mixed into decode steps: raw step times far from an idle node's
    mixed = [s for s in snaps if s.step_tokens is not None and s.step_decode is not None
             and s.step_tokens - s.step_decode > 100]
    assert len(mixed) > 10 and max(s.running or 0 for s in snaps) >= 12
    raw = [s.itl_s for s in snaps if s.itl_s is not None]
    assert max(raw) > 3 * min(raw)
    learned = _fresh_factors(b)
    assert all(0.8 <= f <= 1.25 for f in learned[3:]), (min(learned), max(learned))
    assert b.fleet.nodes[b.address(0)].breaker.state is State.CLOSED


@pytest.mark.parametrize("profile", ["8b-h100", "34b-a100"])
def test_a_lone_long_prompt_leaves_a_healthy_nodes_factor_alone(profile: str) -> None:
    b = Bench(profile)
    b.advance(1.0)
    b.send(8000, 5, node=0)
    b.advance(10.0)
    after = b.send(3000, 5, node=0)
    b.drain()
    assert 0.8 <= b.fleet.nodes[b.address(0)].speed.factor <= 1.25
    assert after is not None and after.predicted is not None and after.realised is not None
    assert after.predicted == pytest.approx(after.realised, rel=0.25)


@pytest.mark.parametrize("slow", [2.0, 2.5])
def test_a_node_slower_than_the_breakers_bar_under_a_flood_of_long_prompts_learns_its_slowness(slow: float) -> None:
    """Every interval of a long-prompt flood is mostly prefill, whose step ratio counts only when it
    reads past the breaker's bar (3 x): below it, a slowed node's speed was never learned (attack53), and
    kvgate sent it work as if it were healthy. The floor such an interval proves is learned instead: here,
    where the node cannot keep up and each of its steps is full (a slowed node that keeps up proves less,
    and is read as before)."""
    b = Bench("8b-h100", nodes=2, slow={1: slow})
    t = 0.0
    while t < 10.0:
        for i in range(2):
            b.send(4000, 16, node=i)
        t += 0.15
        b.advance(t)
    slowed, healthy = b.fleet.nodes[b.address(1)], b.fleet.nodes[b.address(0)]
    assert all(s.step_fresh is not True or s.step_tokens is None or s.step_decode is None
               or s.step_tokens - s.step_decode > 1000 for s in b.snaps[1][2:])  # mostly prefill, every one
    assert 0.85 * slow <= slowed.speed.factor <= 1.15 * slow
    assert healthy.speed.factor <= 1.05  # ... and says nothing on the healthy node beside it
    assert slowed.breaker.state is State.CLOSED and healthy.breaker.state is State.CLOSED


def test_floors_raise_the_speed_factor_only_on_average_and_past_a_slack() -> None:
    noisy = Speed()
    for f in [1.3, 0.8, 1.2, 0.9, 1.25, 0.85, 1.15, 0.95] * 5:  # a healthy node's floors under step noise
        noisy.bound(f)
    assert noisy.factor == 1.0 and noisy.readings == 0
    slow = Speed()
    slow.bound(2.99)
    slow.bound(2.99)
    assert slow.factor == 1.0  # not on one or two floors
    for _ in range(20):
        slow.bound(2.99)
    assert 2.99 / FLOOR_SLACK - 0.05 <= slow.factor <= 2.99
    learned = Speed()
    learned.observe(3.2)
    for _ in range(10):
        learned.bound(2.99)  # below a factor already learned: nothing to raise
    assert learned.factor == 3.2 and learned.readings == 1


def test_the_floor_of_a_mostly_prefill_interval_is_its_latency_over_a_full_steps() -> None:
    m = StepModel(a=0.010, b=0.0001, c=0.001, d=0.0, max_batched_tokens=2048)
    # a full step beside 4 decodes: 10 + 204.8 x 1 + 4 ms; the interval's own mean batch does not enter
    assert step_floor(m, 0.2188, 1500.0, 4.0, 9.0, 0.0) == pytest.approx(1.0)
    assert step_floor(m, 0.2188, 300.0, 4.0, 9.0, 0.0) == pytest.approx(1.0)
    assert step_floor(m, 0.1094, 1500.0, 4.0, None, 0.0) == pytest.approx(0.5)
    # at most step_ratio, whatever the batch: the interval could not have prefilled more in a step
    for tokens, decode in ((60.0, 10.0), (1500.0, 4.0), (2048.0, 1.0)):
        assert step_floor(m, 0.05, tokens, decode, None, 0.0) <= step_ratio(m, 0.05, tokens, decode, None, 0.0)
    assert step_floor(m, None, 1500.0, 4.0, 9.0, 0.0) is None and step_floor(m, 0.0, 1500.0, 4.0, 9.0, 0.0) is None
    # a mean step larger than the prior's budget: the node's budget is not the prior's, no floor is proved
    assert step_floor(m, 0.5, 4000.0, 4.0, 9.0, 0.0) is None


def test_a_prior_with_a_smaller_step_budget_than_the_nodes_does_not_read_a_healthy_flooded_node_as_slow() -> None:
    b = Bench("8b-h100", nodes=1, nodes_config={"performance": {"profile": "8b-h100", "max_num_batched_tokens": 2048}})
    t = 0.0
    while t < 10.0:  # more prefill than the node can take: every step is its full 8,192 tokens
        b.send(4000, 16, node=0)
        t += 0.05
        b.advance(t)
    assert b.snaps[0][-1].step_tokens == pytest.approx(8192, rel=0.01)
    assert b.fleet.nodes[b.address(0)].speed.factor <= 1.05


def test_the_speed_factor_follows_readings_and_is_bounded() -> None:
    s = Speed()
    s.observe(4.0)
    assert s.factor == 4.0 and s.readings == 1  # the first reading is taken as it is
    s.observe(1.0)
    assert 1.0 < s.factor < 4.0
    s.observe(1e9)
    assert s.factor <= MAX_FACTOR
    low = Speed()
    low.observe(0.0)
    assert low.factor == MIN_FACTOR


def test_step_ratio_compares_with_the_batch_that_ran() -> None:
    m = StepModel(a=0.010, b=0.0001, c=0.001, d=0.0, max_batched_tokens=2048)
    # 10 decodes and 50 prefill tokens a step: the model says 10 + 5 + 10 ms, whatever vLLM says is running
    assert step_ratio(m, 0.025, 60.0, 10.0, 99.0, 0.0) == pytest.approx(1.0)
    assert step_ratio(m, 0.050, 60.0, 10.0, None, 0.0) == pytest.approx(2.0)
    # no iteration histogram (an older vLLM): the running sequences are taken as the batch
    assert step_ratio(m, 0.040, None, None, 30.0, 0.0) == pytest.approx(1.0)
    assert step_ratio(m, None, 1010.0, 10.0, 5.0, 0.0) is None  # no decode step: nothing to say
    assert step_ratio(m, 0.0, 1010.0, 10.0, 5.0, 0.0) is None
    assert m.chunk(100) == 1948  # running sequences first: a token of the budget each
    assert StepModel(0.01, 0, 0, 0, max_batched_tokens=2048, max_seqs=4096).chunk(2000) == 2048 / 16  # a floor
    assert m.prefill(0, 0, 0) == 0.0
    assert m.prefill(4096, 0, 0) == pytest.approx(2 * 0.010 + 0.0001 * 4096)  # two full chunks


# -- c. the breaker on healthy and on slowed nodes --------------------------------------------------


TWO_TIERS: dict[str, Any] = {
    "tenants": [{"name": "app", "tier": "interactive"}, {"name": "docs", "tier": "standard"}],
    "queue": {"inject_priority": True},
    "nodes": {"static": [{"address": "node-0:8000", "probe": "http://node-0:9102"}]},
}


def _mixed(rate: float, seconds: float, seed: int) -> list[Any]:
    return poisson([Stream("app", SHORT, const(rate * 0.8)), Stream("docs", LONG, const(rate * 0.2), max_tokens=1024)],
                   seconds, seed)


@pytest.mark.parametrize(("profile", "rate", "seconds"), [("8b-h100", 50.0, 240.0), ("34b-a100", 3.1, 300.0)])
def test_no_latency_breaker_opens_on_a_healthy_busy_mixed_fleet(profile: str, rate: float, seconds: float) -> None:
    """Three nodes at ~65% of capacity, short and long prompts mixed: prefill-heavy batches make steps
    several times longer than an idle node's, which is load, not sickness."""
    r = simulate(parse_config(TWO_TIERS), Policy("kvgate", 3, "kvgate"), get_profile(profile),
                 _mixed(rate, seconds, 5), seed=1)
    assert r.breaker_opens_by_cause.get("latency", 0) == 0, r.breaker_opens_by_cause
    served = [o for o in r.outcomes if o.status == 200]
    assert len(served) > 0.95 * len(r.outcomes) and r.lost == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_slowed_node_opens_on_latency_within_10_s(seed: int) -> None:
    run = Run(parse_config(TWO_TIERS), Policy("kvgate", 3, "kvgate"), get_profile("8b-h100"), _mixed(50.0, 45.0, seed),
              seed=seed, degrade=(Degrade(20.0, 0, 6.0),))
    run.run()
    opens = [(t, node, why) for t, node, _, new, why in run.transitions if new == "open"]
    assert opens, run.transitions
    t, node, why = opens[0]
    assert node == "node-0:8000" and 20.0 < t <= 30.0 and why.startswith("step time"), opens[0]
    assert all(n == "node-0:8000" for _, n, _ in opens)  # the healthy ones stay closed
    assert run.breaker_opens_by_cause["latency"] == 1


def test_healthy_nodes_learn_a_latency_baseline_near_their_model() -> None:
    bad = []
    for seed in range(1, 11):
        run = Run(parse_config(TWO_TIERS), Policy("kvgate", 3, "kvgate"), get_profile("34b-a100"),
                  _mixed(3.1, 30.0, seed), seed=seed)
        run.run()
        assert run.core is not None and run.core.fleet is not None
        for address, n in run.core.fleet.nodes.items():
            if n.breaker.baseline is None or not 0.8 <= n.breaker.baseline <= 1.25:
                bad.append((seed, address, n.breaker.baseline))
    assert not bad


def test_a_reading_polled_twice_counts_once() -> None:
    cfg = parse_config({"nodes": {"static": [{"address": f"10.0.0.{i}:8000", "probe": f"http://p{i}"}
                                             for i in range(2)]}})
    assert cfg.nodes is not None
    f = Fleet(cfg.nodes, random.Random(1))
    m = f.model

    def reading(at: float, ratio: float) -> Snapshot:
        return Snapshot(node="n", at=at, ok=True, kv_usage=0.2, blocks_total=1000, block_size=16, running=8,
                        itl_s=ratio * m.step(0, 8, 3200), step_fresh=True, step_tokens=8.0, step_decode=8.0)

    for k in range(6):
        for i in range(2):
            f.on_snapshot(f"10.0.0.{i}:8000", reading(k, 1.0), k)
    sick = f.nodes["10.0.0.0:8000"]
    for t in (6.0, 6.5):  # two slow probe readings, each polled twice
        snap = reading(t, 10.0)
        f.on_snapshot(sick.address, snap, t)
        f.on_snapshot(sick.address, snap, t + 0.25)
    assert sick.speed.readings == 8
    assert sick.breaker.state is State.CLOSED


@pytest.mark.parametrize("preempting", [False, True])
def test_a_mostly_prefill_interval_with_preemptions_proves_no_floor(preempting: bool) -> None:
    """vLLM's inter-token latency spans a preempted request's wait to resume, not one step: an interval
    that preempted says nothing of how slow the node's steps are."""
    cfg = parse_config({"nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://p1"}]}})
    assert cfg.nodes is not None
    f = Fleet(cfg.nodes, random.Random(1))
    m, node = f.model, "10.0.0.1:8000"
    for k in range(8):  # full steps beside 4 decodes, each 2x what the prior says: under the breaker's bar
        f.on_snapshot(node, Snapshot(node="n", at=k, ok=True, kv_usage=0.1, blocks_total=1000, block_size=16,
                                     running=4, itl_s=2.0 * m.step(m.max_batched_tokens, 4, 1600), step_fresh=True,
                                     step_tokens=float(m.max_batched_tokens), step_decode=4.0,
                                     preemptions_per_s=0.5 if preempting else 0.0), k)
    speed = f.nodes[node].speed
    assert (speed.floors, speed.factor > 1.5) == ((0, False) if preempting else (8, True))


# -- d. the probe's step figures -------------------------------------------------------------------


def test_step_figures_come_from_the_simulated_nodes_exposition() -> None:
    """What the sim node's /metrics says (sim/metrics.py, vLLM's names and types), parsed and derived
    as the probe does: tokens per step and decode tokens per step over the interval."""
    engine = Engine(get_profile("8b-h100"), EngineOptions(seed=1))
    metrics = NodeMetrics(engine, "m")
    d = Deriver("n")
    now = 0.0

    def expose() -> Snapshot:
        return d.update(parse(generate_latest(metrics.registry).decode()), now)

    first = expose()
    assert first.step_fresh is None and first.step_tokens is None and first.step_decode is None
    assert expose().step_fresh is False  # nothing ran: no step-time news
    for i in range(6):
        engine.add(SimRequest(f"r{i}", 1000 + 500 * i, 30, now))
    steps0, tokens0, gen0 = engine.steps, engine.step_tokens, engine.scheduler.generation_tokens
    for _ in range(20):
        dt = engine.begin_step(now)
        assert dt is not None
        now += dt
        engine.end_step(now)
    s = expose()
    steps = engine.steps - steps0
    assert s.step_fresh is True
    assert s.step_tokens == pytest.approx((engine.step_tokens - tokens0) / steps)
    assert s.step_decode == pytest.approx((engine.scheduler.generation_tokens - gen0) / steps)
    assert s.step_tokens is not None and s.step_decode is not None
    assert s.step_tokens > s.step_decode > 0  # prefill and decode in the same steps
    assert s.itl_s is not None and s.itl_s > 0
    idle = expose()
    assert idle.step_fresh is False and idle.step_tokens is None  # no step since


def test_step_figures_from_the_real_vllm_exposition() -> None:
    text = REFERENCE.read_text()
    d = Deriver("n")
    first = d.update(parse(text), 0.0)
    assert first.step_fresh is None and first.step_tokens is None  # one reading: no interval yet

    def bumped(src: str, itl: tuple[float, float], iteration: tuple[float, float] | None, gen: float) -> str:
        out = []
        for line in src.splitlines():
            name, _, value = line.rpartition(" ")
            if line.startswith("vllm:inter_token_latency_seconds_sum"):
                line = f"{name} {float(value) + itl[0]}"
            elif line.startswith("vllm:inter_token_latency_seconds_count"):
                line = f"{name} {float(value) + itl[1]}"
            elif line.startswith("vllm:iteration_tokens_total"):
                if iteration is None:
                    continue
                if line.startswith("vllm:iteration_tokens_total_sum"):
                    line = f"{name} {float(value) + iteration[0]}"
                elif line.startswith("vllm:iteration_tokens_total_count"):
                    line = f"{name} {float(value) + iteration[1]}"
            elif line.startswith("vllm:generation_tokens_total"):
                line = f"{name} {float(value) + gen}"
            out.append(line)
        return "\n".join(out) + "\n"

    # 100 steps of 3000 tokens, 1200 of them generated: 30 tokens a step, 12 decoding
    s = d.update(parse(bumped(text, (2.4, 1200), (3000.0, 100), 1200)), 1.0)
    assert s.step_fresh is True and s.itl_s == pytest.approx(2.4 / 1200)
    assert s.step_tokens == pytest.approx(30.0) and s.step_decode == pytest.approx(12.0)

    # a vLLM without the iteration-tokens histogram: no batch figures, and nothing breaks
    old = Deriver("n")
    stripped = bumped(text, (0, 0), None, 0)
    assert "vllm:iteration_tokens_total_count" not in stripped
    old.update(parse(stripped), 0.0)
    s2 = old.update(parse(bumped(stripped, (2.4, 1200), None, 1200)), 1.0)
    assert s2.step_fresh is True and s2.step_tokens is None and s2.step_decode is None
    cfg = parse_config({"nodes": {"static": [{"address": "a:1", "probe": "http://p"}]}})
    assert cfg.nodes is not None
    f = Fleet(cfg.nodes, random.Random(1))
    f.on_snapshot("a:1", s2, 1.0)  # the running sequences stand in for the batch
    n = f.nodes["a:1"]
    assert n.speed.readings == 1 and n.latency is not None and n.latency > 0
    assert f.choose(100, 1.0, prompt_tokens=50).node is n
    again = Snapshot.from_json(s.to_json())
    assert (again.step_fresh, again.step_tokens, again.step_decode) == (True, 30.0, 12.0)


# -- e. config -------------------------------------------------------------------------------------------


NODE = {"static": [{"address": "a:1", "probe": "http://p"}]}


def test_the_old_node_queue_caps_are_off_by_default_and_deprecated_when_set() -> None:
    default = parse_config({"nodes": NODE})
    assert default.nodes is not None
    assert (default.nodes.max_waiting_requests, default.nodes.max_prefill_tokens) == (None, None)
    assert default.nodes.deprecations() == []
    cfg = parse_config({"nodes": {**NODE, "max_waiting_requests": 4}})
    assert cfg.nodes is not None and cfg.nodes.max_waiting_requests == 4
    [note] = cfg.nodes.deprecations()
    assert "nodes.max_waiting_requests" in note and "deprecated" in note
    both = parse_config({"nodes": {**NODE, "max_waiting_requests": 4, "max_prefill_tokens": 9000}})
    assert both.nodes is not None
    assert [n.split()[0] for n in both.nodes.deprecations()] == ["nodes.max_waiting_requests",
                                                                 "nodes.max_prefill_tokens"]

    class Log:
        def __init__(self) -> None:
            self.warnings: list[tuple[str, dict[str, Any]]] = []

        def warning(self, event: str, **kw: Any) -> None:
            self.warnings.append((event, kw))

        def debug(self, *a: Any, **kw: Any) -> None: ...

        info = error = exception = debug

    log = Log()
    Core(both, FakeClock(), log=log)
    assert [e for e, _ in log.warnings].count("config_deprecated") == 2


def test_an_unknown_performance_profile_is_an_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"nodes\.performance\.profile: unknown profile 'h200-mystery'"):
        parse_config({"nodes": {**NODE, "performance": {"profile": "h200-mystery"}}})
    with pytest.raises(ConfigError, match=r"nodes\.performance\.a_ms"):
        parse_config({"nodes": {**NODE, "performance": {"a_ms": -1}}})
    with pytest.raises(ConfigError, match=r"nodes\.performance\.b_ms: unknown setting"):
        parse_config({"nodes": {**NODE, "performance": {"b_ms": 1}}})


def test_figures_override_the_profile() -> None:
    p = get_profile("34b-a100")
    m = from_config(Performance(profile="34b-a100"))
    assert (m.a, m.b, m.c, m.d) == pytest.approx((p.a_ms / 1000, p.b_ms_per_prefill_token / 1000,
                                                  p.c_ms_per_decode_seq / 1000, p.d_ms_per_context_token / 1000))
    assert (m.max_batched_tokens, m.max_seqs) == (p.max_num_batched_tokens, p.max_num_seqs)
    o = from_config(Performance(profile="34b-a100", a_ms=10.0, d_ms_per_context_token=0.0, max_num_batched_tokens=4096))
    assert o.a == pytest.approx(0.010) and o.d == 0.0 and o.max_batched_tokens == 4096
    assert o.b == m.b and o.c == m.c and o.max_seqs == m.max_seqs  # the rest stays the profile's
    cfg = parse_config({"nodes": {**NODE, "performance": {"profile": "8b-a100", "c_ms_per_decode_seq": 1.0}}})
    assert cfg.nodes is not None
    f = Fleet(cfg.nodes)
    assert f.model.c == pytest.approx(0.001) and f.model.a == pytest.approx(get_profile("8b-a100").a_ms / 1000)
    assert parse_config({"nodes": NODE}).nodes.performance.profile == "8b-h100"  # type: ignore[union-attr]


# -- f. the fleet-caused 429 ------------------------------------------------------------------------


def E(prompt: int = 10, out: int = 10) -> Estimate:
    return Estimate(prompt_tokens=prompt, output_tokens=out, parsed=True, stream=False)


STEADY = [1.0] * 20
SLOWED = STEADY + [5.0] * 5
"""Requests that lasted 1 s, then 5 s: the recent mean pulls far away from the slow norm."""
A_BIT_SLOWER = STEADY + [1.4] * 10
SUSTAINED = STEADY + [3.0] * 60
"""Slowed for 60 requests on end: the norm (the tenant's duration on a healthy fleet) must not follow."""


@pytest.mark.parametrize(("durations", "tenant", "spent", "reason", "fleet"), [
    (STEADY, {}, None, "tenant-concurrency", False),
    (SLOWED, {}, None, "tenant-concurrency", True),
    (A_BIT_SLOWER, {}, None, "tenant-concurrency", False),
    (SUSTAINED, {}, None, "tenant-concurrency", True),
    (SLOWED, {"requests_per_minute": 600}, None, "tenant-concurrency", True),
    (SLOWED, {"tokens_per_minute": 60_000}, None, "tenant-concurrency", True),
    (SLOWED, {"requests_per_minute": 600}, "requests", "tenant-concurrency", False),
    (SLOWED, {"tokens_per_minute": 60_000}, "tokens", "tenant-concurrency", False),
    (SLOWED, {"requests_per_minute": 600, "max_concurrent": None}, "requests", "tenant-requests", False),
    (SLOWED, {"tokens_per_minute": 60_000, "max_concurrent": None}, "tokens", "tenant-tokens", False),
    ([], {}, None, "tenant-concurrency", False),  # no history: no norm to compare with
])
def test_a_concurrency_429_is_the_fleets_doing_only_when_the_tenant_is_within_budget_and_slowed(
        durations: list[float], tenant: dict[str, Any], spent: str | None, reason: str, fleet: bool) -> None:
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t", "max_concurrent": 2, **tenant}], "queue": {"enabled": False}})
    a = Admission(cfg, clock, random.Random(1))
    t = cfg.tenant("t")
    for i, d in enumerate(durations):  # one at a time, each lasting d seconds
        lease = a.decide(t, f"w{i}", E(), 10).lease
        assert lease is not None
        clock.advance(d)
        a.complete(lease.ticket, Usage(10, 10), responded=True)
        clock.advance(1.0)
    if t is not None and t.max_concurrent is not None:
        for i in range(t.max_concurrent):
            assert a.decide(t, f"h{i}", E(), 10).admitted
    state = a.tenant_state("t")
    assert state is not None
    now = clock()
    if spent == "requests":
        assert state.requests is not None
        state.requests.take(state.requests.available(now), now)
    elif spent == "tokens":
        assert state.tokens is not None
        state.tokens.take(state.tokens.available(now), now)
    probe = a.decide(t, "x", E(), 10)
    assert probe.rejection is not None and probe.rejection.status == 429 and probe.rejection.reason == reason
    assert probe.rejection.fleet_caused is fleet
    if durations:
        assert state.norm_seconds is not None and state.mean_seconds is not None
        assert (state.mean_seconds > 1.5 * state.norm_seconds) is (durations is SLOWED or durations is SUSTAINED)


def test_fleet_caused_429s_and_predicted_misses_are_counted_for_the_scaler() -> None:
    """Through the core: the 429's flag reaches kvgate_fleet_caused_rejections_total, and a request
    dispatched with a predicted TTFT past its tier's target is an admitted ``slo_miss``."""
    clock = FakeClock()
    cfg = parse_config({
        "tiers": {"interactive": {"priority": 0, "max_queue_wait_ms": 5000, "ttft_target_ms": 200}},
        "nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://p"}],
                  "performance": {"profile": "34b-a100"}},
        "tenants": [{"name": "t", "tier": "interactive", "api_key_sha256": [hash_key("k")], "max_concurrent": 50}]})
    core = Core(cfg, clock, random.Random(1), log=null_logger())
    core.snapshot("10.0.0.1:8000", Snapshot(node="n", at=0, ok=True, kv_usage=0.0, blocks_total=2537,
                                            block_size=16, running=0, waiting=0))

    def ask(rid: str, prompt: int) -> Any:
        return core.decide(Request("/v1/chat/completions", rid, "Bearer k", estimate=E(prompt, 10), body_bytes=10))

    quick = ask("q", 100)  # an idle node: ~0.1 s to its first token
    assert not isinstance(quick, Held) and quick.decision.lease is not None
    assert quick.decision.lease.predicted_ttft is not None and quick.decision.lease.predicted_ttft < 0.2
    assert quick.decision.lease.slo_miss is False
    long = ask("l", 1500)  # ~0.5 s of its own prefill: past the 200 ms target on any node, so no
    assert not isinstance(long, Held) and long.decision.lease is not None  # node count would help it
    assert long.decision.lease.predicted_ttft is not None and long.decision.lease.predicted_ttft > 0.2
    assert long.decision.lease.slo_miss is False
    slow = ask("s", 100)  # behind that prefill: late because the fleet is busy, which more nodes fix
    assert not isinstance(slow, Held) and slow.decision.lease is not None
    assert slow.decision.lease.slo_miss is True
    assert slow.decision.lease.predicted_ttft is not None and slow.decision.lease.predicted_ttft > 0.2
    # ~4.3 s of its own prefill behind ~0.6 s of work: its first token past its 5 s max wait on every
    # node — refused at once, with the predicted wait (on an idle node it would go)
    doomed = ask("d", 14_000)
    assert not isinstance(doomed, Held)
    assert doomed.decision.rejection is not None
    assert (doomed.decision.rejection.status, doomed.decision.rejection.reason) == (503, "queue-deadline")
    # told to come back when it would go: its first token within its max wait (read as when its first token
    # met its target, too long by its own 4.3 s prefill) — and coming back then, it goes
    ra = doomed.decision.rejection.retry_after
    assert ra is not None and ra < 1.0
    clock.advance(ra)
    again = ask("d2", 14_000)
    assert not isinstance(again, Held) and again.decision.lease is not None
    text = generate_latest(core.stats.registry).decode()
    assert 'kvgate_predicted_slo_misses_total{pool="default",tenant="t",tier="interactive"} 1.0' in text


def test_the_prefill_sent_to_the_nodes_is_counted_for_the_scaler() -> None:
    """kvgate_prefill_seconds_total: each request placed adds its prompt's prefill on its node, by the node's
    model (``b`` per token) and learned speed — what the scaler's scale-down bound on prefill reads."""
    clock = FakeClock()
    cfg = parse_config({
        "nodes": {"static": [{"address": "10.0.0.1:8000", "probe": "http://p"}],
                  "performance": {"profile": "34b-a100"}},
        "tenants": [{"name": "t", "tier": "standard", "api_key_sha256": [hash_key("k")]}]})
    core = Core(cfg, clock, random.Random(1), log=null_logger())
    core.snapshot("10.0.0.1:8000", Snapshot(node="n", at=0, ok=True, kv_usage=0.0, blocks_total=2537,
                                            block_size=16, running=0, waiting=0))
    b = get_profile("34b-a100").b_ms_per_prefill_token / 1000.0
    # the pool's series is there from the start, at 0 (PromQL's increase() misses a first increment)
    assert 'kvgate_prefill_seconds_total{pool="default"} 0.0' in generate_latest(core.stats.registry).decode()
    for rid, prompt in (("a", 1000), ("b", 3000)):
        a = core.decide(Request("/v1/chat/completions", rid, "Bearer k", estimate=E(prompt, 10), body_bytes=10))
        assert not isinstance(a, Held) and a.decision.lease is not None
    assert core.prefill_seconds == {"default": pytest.approx(4000 * b)}
    from scaler.signals import parse_kvgate  # (the scaler's scrape path reads the same)

    page = parse_kvgate(generate_latest(core.stats.registry).decode())
    assert page.pools["default"].totals[("prefill", "")] == pytest.approx(4000 * b)


def test_counter_of_fleet_caused_rejections_moves() -> None:
    clock = FakeClock()
    cfg = parse_config({"tenants": [{"name": "t", "api_key_sha256": [hash_key("k")], "max_concurrent": 1}],
                        "queue": {"enabled": False}})
    core = Core(cfg, clock, random.Random(1), log=null_logger())

    def ask(rid: str) -> Any:
        a = core.decide(Request("/v1/chat/completions", rid, "Bearer k", estimate=E(), body_bytes=10))
        assert not isinstance(a, Held)
        return a

    from ext_proc.core import Ended

    for i, d in enumerate([1.0] * 20 + [5.0] * 5):
        a = ask(f"w{i}")
        clock.advance(d)
        core.ended(Ended(a.ticket, f"w{i}", 200, Usage(10, 10), upstream_answered=True))
    assert ask("held").decision.admitted
    r = ask("x").decision.rejection
    assert r is not None and r.reason == "tenant-concurrency" and r.fleet_caused
    text = generate_latest(core.stats.registry).decode()
    assert 'kvgate_fleet_caused_rejections_total{pool="default",tenant="t",tier="standard"} 1.0' in text
    samples = Counter(line.split("{")[0] for line in text.splitlines() if line.startswith("kvgate_fleet_caused"))
    assert samples == {"kvgate_fleet_caused_rejections_total": 1, "kvgate_fleet_caused_rejections_created": 1}


# -- g. bookings, limits and reloads (review findings) -------------------------------------------------


def _fleet(profile: str = "34b-a100", nodes: int = 1, inject: bool = True) -> Fleet:
    from ext_proc.config import Nodes
    from ext_proc.nodes import Level

    cfg = Nodes.model_validate({"static": [{"address": f"10.0.0.{i}:8000", "probe": f"http://p{i}"}
                                           for i in range(nodes)], "performance": {"profile": profile}})
    f = Fleet(cfg, rng=random.Random(1))
    f.set_levels([Level(0, 0.2), Level(1, 1.0), Level(2, 5.0)] if inject else [Level(0, 0.2)])
    return f


def _idle(f: Fleet, now: float) -> None:
    for n in f.nodes.values():
        f.on_snapshot(n.address, Snapshot(node=n.address, at=now, ok=True, kv_usage=0.0, blocks_total=2537,
                                          block_size=16, running=0.0, waiting=0.0), now)


def test_a_booking_that_never_ran_stops_counting_once_it_ends_or_the_node_reads_idle() -> None:
    f = _fleet()
    _idle(f, 0.0)
    node = next(iter(f.nodes.values()))
    quiet = f.predict(node, 100, 0, 0.0)
    c = f.place(15_000, 14_000, "big", 0.0, priority=2, target=5.0, limit=30.0)
    assert c.node is node and f.predict(node, 100, 0, 0.1) > 1.0  # its chunks hold the node's steps
    f.completed(node.address, "big", 0, False, 0.2)  # it failed at once (or its prefix was cached)
    # its booking is gone; until the next reading the node still counts it as sent (a decode step's
    # wait), not as 4.5 s of prefill
    assert quiet < f.predict(node, 100, 0, 0.2) < 2 * quiet
    f.place(15_000, 14_000, "big2", 0.3, priority=2, target=5.0, limit=30.0)
    assert f.predict(node, 100, 0, 0.4) > 1.0
    _idle(f, 0.5)  # the next reading: nothing running, nothing waiting
    assert f.predict(node, 100, 0, 0.5) == pytest.approx(quiet, rel=0.05)


def test_a_prompt_too_long_for_its_target_is_still_sent_to_an_idle_node() -> None:
    f = _fleet(nodes=3)
    _idle(f, 0.0)
    # 4,000 tokens on a 34B/A100: ~1.3 s of prefill alone, over the top tier's 1 s max wait
    c = f.place(4_100, 4_000, "t", 0.0, priority=0, target=0.2, limit=1.0)
    assert c.node is not None and c.ttft is not None and c.ttft > 1.0


def test_a_running_prefill_at_the_same_level_is_counted_once() -> None:
    f = _fleet()
    _idle(f, 0.0)
    node = next(iter(f.nodes.values()))
    f.place(41_000, 40_000, "long", 0.0, priority=1, target=1.0, limit=60.0)
    m = f.model
    ahead = m.prefill(40_000, 1, 0)
    got = f.predict(node, 100, 1, 0.5)
    assert got < ahead  # what is left of the running prefill (it started 0.5 s ago), plus its own: not twice


def test_a_new_performance_prior_starts_the_learned_factors_over() -> None:
    f = _fleet(profile="8b-h100")
    node = next(iter(f.nodes.values()))
    node.speed.observe(6.0)
    node.breaker.baseline, node.breaker._samples = 6.0, 10
    cfg = f.cfg.model_copy(update={"performance": Performance(profile="34b-a100")})
    f.reconfigure(cfg)
    assert node.speed.factor == 1.0 and node.speed.readings == 0
    assert node.breaker.baseline is None
    same = f.cfg.model_copy()
    node.speed.observe(1.3)
    f.reconfigure(same)  # the same prior: what was learned stays
    assert node.speed.factor == 1.3


# -- h. prefill packing and the step phase (issue 32: TTFT prediction error per node kind) ------------


def _busy(f: Fleet, now: float, running: float = 8.0) -> None:
    """Every node read with ``running`` requests decoding and nothing waiting."""
    for n in f.nodes.values():
        f.on_snapshot(n.address, Snapshot(node=n.address, at=now, ok=True, kv_usage=0.2, blocks_total=2537,
                                          block_size=16, running=running, waiting=0.0), now)


def test_a_prompt_booked_behind_others_packs_into_their_step() -> None:
    """vLLM admits every waiting prompt the step's budget holds: three short prompts sent at once get
    their first tokens from the same step. The node book charges the second and third their share of
    that step, not a step each (it did: the third was predicted three steps out, and kvgate's H100
    predictions ran 13% late on the mixed pool)."""
    f = _fleet(profile="8b-h100", inject=False)
    _busy(f, 0.0)
    node = next(iter(f.nodes.values()))
    f.place(300, 200, "a", 0.0)
    second = f.predict(node, 200, 0, 0.0)
    decode, context = f._load(node)
    f.place(300, 200, "b", 0.0)
    third = f.predict(node, 200, 0, 0.0)
    m = node.model
    # (the third's own step also attends what "b" adds to the context: hence the tolerance)
    assert third - second == pytest.approx(m.packed(200, decode, context), rel=0.05)
    assert third - second < m.prefill(200, decode, context) / 2  # a share of the step, not a step

    # and the simulated node agrees: the three first tokens come out of one step
    engine = Engine(get_profile("8b-h100"), EngineOptions(seed=1))
    for i in range(8):
        engine.add(SimRequest(f"d{i}", 100, 200, 0.0))
    t = 0.0
    for _ in range(3):  # the eight are decoding
        t += engine.begin_step(t) or 0.0
        engine.end_step(t)
    for k in "abc":
        engine.add(SimRequest(k, 200, 10, t))
    firsts: dict[str, float] = {}
    while len(firsts) < 3:
        t += engine.begin_step(t) or 0.0
        for ev in engine.end_step(t):
            if ev.request.id in "abc" and ev.request.first_token is not None:
                firsts.setdefault(ev.request.id, ev.request.first_token)
    assert len(set(firsts.values())) == 1


def test_the_step_in_progress_is_read_from_the_last_request_that_ended() -> None:
    """A request's last token comes at the end of an engine step: right after one ends, most of the next
    step is still ahead of a new request; most of a step later, little is. Without a recent end, half a
    step (the mean)."""
    f = _fleet(profile="8b-h100", inject=False)
    _busy(f, 0.0)
    node = next(iter(f.nodes.values()))
    decode, context = f._load(node)
    step = node.model.step(0, decode, context) * node.speed.factor
    blind = f.predict(node, 200, 0, 1.0)  # no end seen: half a step
    f.place(300, 200, "x", 1.0)
    f.completed(node.address, "x", 300, True, 1.0)
    early = f.predict(node, 200, 0, 1.0 + 0.1 * step)
    late = f.predict(node, 200, 0, 1.0 + 0.9 * step)
    assert early - late == pytest.approx(0.8 * step)
    assert late < blind < early
    stale = f.predict(node, 200, 0, 1.0 + 10.1 * step)  # ten steps on: the phase is lost
    assert stale == pytest.approx(blind, rel=0.01)  # (the ended request is still counted as sent)


def test_a_request_that_did_not_end_at_a_step_says_nothing_of_the_step_in_progress() -> None:
    """A client that left mid-stream, or a 4xx vLLM's API server answered without an engine step, ends a
    request between steps: its end is no step boundary (review12: it moved ``Node.edge``)."""
    f = _fleet(profile="8b-h100", inject=False)
    _busy(f, 0.0)
    node = next(iter(f.nodes.values()))
    blind = f.predict(node, 200, 0, 1.0)
    f.place(300, 200, "x", 1.0)
    f.completed(node.address, "x", 300, True, 1.0, step_end=False)
    assert node.edge is None
    assert f.predict(node, 200, 0, 1.0) == pytest.approx(blind, rel=0.01)


def test_a_short_top_tier_request_gives_back_to_a_less_urgent_clock_only_what_it_added() -> None:
    """A short top-tier prompt sent to a node whose own level is idle but whose less urgent level has a
    backlog adds its packed share of a step to that level's clock (it packs into the backlog's steps), but
    is booked at its own full step. When it ends before its booking does (it failed at once, its prefix
    was cached), the less urgent clock must lose only what it gained — it lost the whole step: ten such
    requests took 28% off a batch backlog's predicted wait (review12)."""
    f = _fleet(profile="8b-h100", inject=True)
    _busy(f, 0.0)
    node = next(iter(f.nodes.values()))
    f.dispatched(node.address, "big", 15_000, 14_000, 0.0, priority=2)
    backlog = node.busy[2]
    for i in range(10):
        t = 0.001 * i
        f.dispatched(node.address, f"s{i}", 300, 100, t, priority=0)
        f.completed(node.address, f"s{i}", 300, True, t)
    assert node.busy[2] == pytest.approx(backlog, abs=1e-9)


def test_a_large_mixed_pools_floor_is_its_fastest_profile_not_its_own() -> None:
    """The floor under a predicted miss ("could more nodes have prevented it": the scaler's demand, best
    effort, the queue's hold) is the fastest node's prefill alone. A pool over ``SCAN_LIMIT`` nodes is
    not walked: its profiles are few — the pool's own (34B on A100s here) was used alone, and a prompt
    the H100s could prefill in time counted as one no node could (review12)."""
    from ext_proc.config import Nodes
    from ext_proc.picker import SCAN_LIMIT
    from ext_proc.profiles import get_profile as prof

    n = SCAN_LIMIT + 8
    cfg = Nodes.model_validate({"static": [{"address": f"10.0.{i // 200}.{i % 200}:8000", "probe": f"http://p{i}",
                                            **({"profile": "34b-h100"} if i % 4 == 0 else {})} for i in range(n)],
                                "performance": {"profile": "34b-a100"}})
    f = Fleet(cfg, rng=random.Random(1))
    assert len(f.nodes) == n
    fast = min(m.model.prefill(3000, 0, 0) for m in f.nodes.values())
    slow = max(m.model.prefill(3000, 0, 0) for m in f.nodes.values())
    assert fast < slow and prof("34b-h100").gpu != prof("34b-a100").gpu
    assert f.floor_ttft(3000) == pytest.approx(fast)


def decoding(nodes: int, one_level: bool = True) -> Bench:
    """``nodes`` 8b-h100 nodes, each decoding four requests (a step in progress, which a new request waits
    out), 0.5 s in; ``one_level``: kvgate writes no priorities (one vLLM level, a 200 ms top-tier target)."""
    from ext_proc.nodes import Level

    b = Bench("8b-h100", nodes=nodes)
    if one_level:
        b.fleet.set_levels([Level(0, 0.2)])
    for k in range(nodes):
        for _ in range(4):
            b.send(50, 400, node=k)
    b.advance(0.5)
    return b


def test_with_one_vllm_level_a_less_urgent_prompt_is_not_packed_into_a_waiting_top_tier_requests_step() -> None:
    """vLLM packs every waiting prompt into each engine step's token budget, and a request's first token
    comes at the end of the step that ran its prefill: a standard prompt booked beside an interactive
    request still waiting for its first token makes that token later by the standard prompt's share of the
    step. On the mixed-gpus scenario each of the 7 late interactive requests (201-232 ms against a 200 ms
    target) had a standard prompt booked onto its node just after it. Such a prompt goes to another ready
    node — checked against the simulator: beside it, the interactive request misses its target (56 ms
    against 32), elsewhere it does not (16 ms) — unless the other node would miss its own target."""

    def run(std_node: int | None, limit: float = 1.0) -> tuple[int, int, float, float]:
        b = decoding(2)
        n0 = b.fleet.nodes[b.address(0)]
        target = b.fleet.predict(n0, 100, 0, b.now) + 0.5 * n0.model.b * 2000 * n0.speed.factor
        top = b.send(100, 16, urgent=True, target=target, limit=1.0)
        assert top is not None and top.node == 0
        b.send(1000, 16, node=1)  # node 1 later for the standard prompt (77 ms against 59), still ready
        c = b.fleet.choose(2016, b.now, prompt_tokens=2000, target=limit, limit=limit, urgent=False)
        assert c.node is not None
        chosen = int(c.node.address.split("-")[1].split(":")[0])
        start = b.now
        b.send(2000, 16, node=chosen if std_node is None else std_node)
        b.advance(start + 0.5)
        assert top.req.first_token is not None
        return top.node, chosen, top.req.first_token - start, target

    top_node, chosen, ttft, target = run(None)
    assert chosen != top_node and ttft <= target
    _, _, late, _ = run(top_node)
    assert late > target  # beside it, the interactive request would have missed its target
    _, tight, _, _ = run(None, limit=0.065)
    assert tight == top_node  # one the other node would make miss its target takes the soonest node


def test_one_level_a_prompt_goes_to_a_busier_node_when_each_ready_node_has_a_top_tier_request_waiting() -> None:
    """With one vLLM level a less urgent prompt goes to a node ready for the top tier, preferably one where
    it makes no waiting top-tier request late (``Picker._late_beside``). Where every ready node has such a
    request and two or more are ready, it goes to a node not ready where it makes none late, if it makes
    its own target there with the queue ahead counted twice: the ready nodes stay as they were. Before,
    it went beside one of them (mixed-gpus seed 1: an interactive request 215 ms against 200, a
    3,663-token standard prompt booked beside it while an H100 with nothing of the top tier waiting would
    have taken it first). Checked against the simulator: both top-tier requests make their
    targets and the prompt its own; beside the first, that one would have missed its target."""

    def run(std_node: int | None, limit: float = 1.0) -> tuple[list[Sent], int, float, list[float]]:
        b = decoding(3)
        b.send(8000, 16, node=2)  # node 2 not ready for the top tier (160 ms of prefill ahead)
        n2 = b.fleet.nodes[b.address(2)]
        assert b.fleet.predict(n2, 0, 0, b.now) > READY_SHARE * 0.2
        tops, targets = [], []
        for _ in range(2):
            n = b.fleet.nodes[b.address(len(tops))]
            target = b.fleet.predict(n, 100, 0, b.now) + 0.5 * n.model.b * 2000 * n.speed.factor
            top = b.send(100, 16, urgent=True, target=target, limit=1.0)
            assert top is not None
            tops.append(top)
            targets.append(target)
        assert sorted(t.node for t in tops) == [0, 1]  # each ready node has one waiting
        margin = b.fleet.predict(n2, 2000, 0, b.now) + b.fleet.predict(n2, 0, 0, b.now)
        assert (margin <= limit) == (limit == 1.0)  # node 2 makes the target with the margin, 0.1 s not
        c = b.fleet.choose(2016, b.now, prompt_tokens=2000, target=limit, limit=limit, urgent=False)
        assert c.node is not None
        chosen = int(c.node.address.split("-")[1].split(":")[0])
        start = b.now
        std = b.send(2000, 16, node=chosen if std_node is None else std_node)
        assert std is not None
        b.advance(start + 1.0)
        assert all(t.req.first_token is not None for t in tops) and std.req.first_token is not None
        return [*tops, std], chosen, start, targets

    sent, chosen, start, targets = run(None)
    assert chosen == 2
    *tops, std = sent
    for top, target in zip(tops, targets, strict=True):
        assert top.req.first_token is not None and top.req.first_token - start <= target
    assert std.realised is not None and std.realised <= 1.0  # and the prompt makes its own target
    sent, _, start, targets = run(tops[0].node)
    first = sent[0]
    assert first.node == tops[0].node  # the same run up to the prompt
    assert first.req.first_token is not None and first.req.first_token - start > targets[0]  # beside it: late
    _, tight, _, _ = run(None, limit=0.1)
    assert tight in (0, 1)  # one the busier node would make miss its own target goes beside them, as before


def test_a_top_tier_request_already_predicted_past_its_target_does_not_keep_a_short_prompt_off_its_node() -> None:
    """review17: ``_late_beside`` asks whether the prompt would *make* a waiting top-tier request miss its
    target. One already predicted past it (a new arrival goes if it can make its max wait) misses it
    whatever is booked beside it — with ``p + extra > d`` it kept every less urgent prompt off the node,
    however small (``extra`` near 0), until its predicted first token: here the only ready node, so a
    16-token standard prompt was held in the gateway queue (with the rule then holding). A top-tier request
    sent past its target is now not booked as waiting on one at all (``Fleet.place``); what is left to pass
    over is an entry that prompts booked beside it pushed past its target (``_packed_beside``), planted
    here."""
    from ext_proc.nodes import Level

    b = Bench("8b-h100", nodes=2)
    b.fleet.set_levels([Level(0, 0.2)])
    b.probe()
    b.send(8000, 16, node=1)  # node 1 not ready for the top tier (167 ms of prefill ahead)
    top = b.send(100, 16, urgent=True, target=0.005, limit=1.0)  # a new arrival sent past its target
    assert top is not None and top.node == 0
    n0 = b.fleet.nodes[b.address(0)]
    assert not n0.top_due  # predicted past its target already: not booked as waiting on one
    n0.top_due.append((b.now + 0.02, b.now + 0.01))  # one pushed past its target by prompts beside it
    c = b.fleet.choose(32, b.now, prompt_tokens=16, target=1.0, limit=5.0, urgent=False)
    assert c.node is n0


def test_an_idle_reading_forgets_the_top_tier_requests_a_node_was_waiting_on() -> None:
    """review17: a reading that shows a node idle (nothing running, nothing waiting, nothing sent since)
    clears its bookings — whatever was booked has run or never needed to — but ``Node.top_due`` stayed
    until each predicted first token: a top-tier request that already ended (failed at once, a cached
    prefix) kept the node closed to less urgent prompts (``Picker._late_beside``)."""
    from ext_proc.nodes import Level
    from gpu_probe.snapshot import Snapshot

    b = Bench("8b-h100", nodes=2)
    b.fleet.set_levels([Level(0, 0.2)])
    b.probe()
    b.send(8000, 16, node=1)  # node 1 not ready for the top tier
    top = b.send(100, 16, urgent=True, target=0.012, limit=1.0)
    assert top is not None and top.node == 0
    a0 = b.address(0)
    n0 = b.fleet.nodes[a0]
    assert n0.top_due
    (ticket,) = n0.requests
    b.fleet.completed(a0, ticket, 116, True, b.now)  # it ended at once
    b.fleet.on_snapshot(a0, Snapshot(node=a0, at=b.now, ok=True, kv_usage=0.0, blocks_total=27306, block_size=16,
                                     running=0.0, waiting=0.0), b.now)
    c = b.fleet.choose(2016, b.now, prompt_tokens=2000, target=1.0, limit=5.0, urgent=False)
    assert c.node is n0


def test_less_urgent_prompts_booked_beside_a_waiting_top_tier_request_add_up() -> None:
    """review17: ``_late_beside`` weighed each less urgent prompt alone against the top-tier request's
    slack; vLLM packs all of them into the same step, so two prompts that each fit the slack made it miss
    its target together (simulator: 56 ms against 42). A prompt booked beside it moves its predicted first
    token later by its share, so the next one is weighed against what is left."""

    b = decoding(3)
    b.send(8000, 16, node=1)  # node 1 not ready for the top tier
    b.send(2000, 16, node=2)  # node 2 ready, later for a standard prompt than node 0
    n0 = b.fleet.nodes[b.address(0)]
    target = b.fleet.predict(n0, 100, 0, b.now) + 0.030  # room for one 1,000-token prompt's share (20 ms)
    start = b.now
    top = b.send(100, 16, urgent=True, target=target, limit=1.0)
    assert top is not None and top.node == 0
    first = b.send(1000, 16, urgent=False, target=1.0, limit=5.0)
    assert first is not None and first.node == 0
    second = b.send(1000, 16, urgent=False, target=1.0, limit=5.0)
    assert second is not None and second.node == 2  # beside the first, it would make it late
    b.advance(start + 0.5)
    assert top.req.first_token is not None and top.req.first_token - start <= target


def test_a_long_prompt_a_reading_shows_running_is_ahead_until_its_booked_end_whatever_its_booked_start() -> None:
    """vLLM admits a waiting request into any step with budget left: a long prompt sent just behind a short
    one is running by the next step, though the book had it start after the short one's end. A reading
    then shows it not waiting, and the book took it for done (at most a chunk ahead): the next request on
    that node was predicted 178 ms against 386 ms in the simulator (mixed-gpus: an interactive request
    predicted 71 ms waited 321). Sent before the reading and not waiting in it, it is running — to its
    booked end, or at most its own cost from the reading (here 348 ms against 386: the short prompt's rest
    is ahead of it too)."""
    b = decoding(1, one_level=False)  # a step in progress, which the two prompts wait out
    b.send(2000, 16, node=0)
    long = b.send(16000, 16, node=0)
    assert long is not None
    n = b.fleet.nodes[b.address(0)]
    end = n.prefills[-1][1]
    b.advance(b.busy[0] or b.now)  # the step ends; the next takes both prompts in
    b.probe()
    assert n.snapshot is not None and n.snapshot.waiting == 0
    assert n.prefills[-1][0] > b.now  # booked to start later: the short one's end
    top = b.send(100, 16, node=0)
    assert top is not None and top.predicted is not None
    b.advance(b.now + 2.0)
    assert top.realised is not None and top.realised > end - top.req.arrival
    assert 0.85 * top.realised <= top.predicted <= 1.1 * top.realised  # (before: 178 ms against 386)


def test_a_reading_that_shows_a_booked_chain_running_bounds_it_by_one_prompts_cost() -> None:
    """attack18: a prompt a reading shows running although booked to start later counts as running — but
    only its own cost from the reading, not to the end of the chain booked ahead of it. A burst of 40
    8,000-token prompts booked one after another, all shown running (vLLM ran them faster than booked: a
    prefix-cache hit, a faster GPU), kept the node's clock at the chain's end, 3.9 s ahead, and readings
    could not bring it down: 126 of 170 interactive requests were refused."""
    from gpu_probe.snapshot import Snapshot

    b = Bench("8b-h100", nodes=1)
    a = b.address(0)
    for k in range(40):
        b.fleet.dispatched(a, f"t{k}", 8016, 8000, 0.0)
    n = b.fleet.nodes[a]
    chain, one = n.prefills[-1][1], n.prefills[-1][1] - n.prefills[-1][0]
    assert chain > 3.0
    b.fleet.on_snapshot(a, Snapshot(node=a, at=0.1, ok=True, kv_usage=0.5, blocks_total=27306, block_size=16,
                                    running=40.0, waiting=0.0), 0.1)
    assert n.busy[0] <= 0.1 + one + 1e-9


def test_a_prompt_that_would_miss_its_own_target_elsewhere_still_goes_beside_a_waiting_top_tier_request() -> None:
    """review18: whether a less urgent prompt can afford to go elsewhere than beside a waiting top-tier
    request was judged against its max wait — but a held request is placed again only while it can make
    its target, so one that would meet its target on the soonest node was held (the top-tier request had
    10 ms of slack) and then refused (503 queue-deadline). It is weighed against its target: one that
    can afford it goes to the other ready node, one that cannot goes to the soonest."""

    b = decoding(2)
    b.send(2000, 16, node=1)  # node 1 ready, later for a standard prompt than node 0
    n0, n1 = b.fleet.nodes[b.address(0)], b.fleet.nodes[b.address(1)]
    top = b.send(100, 16, urgent=True, target=b.fleet.predict(n0, 100, 0, b.now) + 0.010, limit=1.0)
    assert top is not None and top.node == 0
    own = b.fleet.predict(n0, 1000, 0, b.now)
    assert b.fleet.predict(n1, 1000, 0, b.now) > own + 0.005
    c = b.fleet.choose(1016, b.now, prompt_tokens=1000, target=own + 0.005, limit=5.0, urgent=False)
    assert c.node is n0
    roomy = b.fleet.choose(1016, b.now, prompt_tokens=1000, target=1.0, limit=5.0, urgent=False)
    assert roomy.node is n1  # (with room in its target it spares that first token)
    # review19: the other node past its target, within its max wait or not — it goes to the soonest:
    # neither sent past its target nor held (a held request's limit is its target: kept off node 0, the
    # hold found node 0 within it and waited for it)
    between = (own + b.fleet.predict(n1, 1000, 0, b.now)) / 2
    for limit in (between, 5.0):
        c = b.fleet.choose(1016, b.now, prompt_tokens=1000, target=between, limit=limit, urgent=False)
        assert c.node is n0


def test_a_prompt_with_no_other_ready_node_goes_beside_a_waiting_top_tier_request_rather_than_wait() -> None:
    """The step-share rule steers, it does not hold: held for it in the gateway queue (stop 39's and this
    round's first versions), a less urgent prompt waited for each top-tier request in turn (review17 F0:
    a stream of small ones kept every long prompt out) or was later refused, and the families lost more
    than the rule won (199 of 210 against 200). With no other node ready for the top tier it goes beside
    the waiting request — not to the busier node either, though it would make its target there: with one
    node ready, the top tier needs the busy one back soon (``Picker._keep_one_ready``)."""

    b = decoding(2)
    b.send(8000, 16, node=1)  # node 1 not ready for the top tier
    n0, n1 = (b.fleet.nodes[b.address(i)] for i in range(2))
    top = b.send(100, 16, urgent=True, target=b.fleet.predict(n0, 100, 0, b.now) + 0.010, limit=1.0)
    assert top is not None and top.node == 0
    assert b.fleet._late_beside(n0, 1000, b.now)  # it would make that request late
    assert b.fleet.predict(n1, 1000, 0, b.now) + b.fleet.predict(n1, 0, 0, b.now) <= 1.0  # with the margin
    c = b.fleet.choose(1016, b.now, prompt_tokens=1000, target=1.0, limit=5.0, urgent=False)
    assert c.node is n0


def test_a_top_tier_prompt_late_anyway_goes_where_it_makes_no_waiting_top_tier_request_late() -> None:
    """A top-tier prompt whose own prefill alone is longer than its target misses it wherever it goes;
    sent to the soonest node it was packed into the step of the top-tier request waiting there and made
    it miss its target too (bursty-mmpp seed 3: three 300-token chat prompts at 0.71 s, predicted 0.15 s).
    It goes to the soonest node where it makes none late, within its limit — checked against the
    simulator: beside it the short request misses its target, elsewhere it does not. A top-tier prompt
    that can make its own target still goes to the soonest (even where it makes the waiting one late);
    one held in the gateway queue, whose limit is what is left of its target, is within it by the work
    ahead of it (as the refusal rule reads a prompt longer than its limit: review61 M1); with no other
    node within its limit the long one goes to the soonest, and the request waiting there is booked later
    by its share of the step."""

    def run(tight: bool) -> tuple[Sent, Sent, float, list[tuple[float, float]]]:
        b = decoding(2)
        b.send(1000, 16, node=1)  # node 1 a little later than node 0
        n0, n1 = (b.fleet.nodes[b.address(i)] for i in range(2))
        target = b.fleet.predict(n0, 100, 0, b.now) + 0.010
        top = b.send(100, 16, urgent=True, target=target, limit=1.0)
        assert top is not None and top.node == 0
        assert b.fleet._own(n0, 12000) > 0.2  # its own prefill alone is past the top tier's target
        assert b.fleet._late_beside(n0, 12000, b.now)  # and it would make the waiting request late
        assert b.fleet._own(n0, 2000) < 0.2 and b.fleet._late_beside(n0, 2000, b.now)
        short = b.fleet.choose(2016, b.now, prompt_tokens=2000, target=0.2, limit=1.0, urgent=True)
        assert short.node is n0  # (not late anyway, though it makes the waiting one late: the soonest)
        loose = b.fleet.choose(12016, b.now, prompt_tokens=12000, target=0.5, limit=1.0, urgent=True)
        assert loose.node is n0  # its own target, looser than the level's, it makes: the soonest (attack61 F1)
        held = b.fleet.choose(12016, b.now, prompt_tokens=12000, target=0.15, limit=0.15, urgent=True)
        assert held.node is n1  # held, its limit what is left of its target: within it by the work ahead
        t0, t1 = b.fleet.predict(n0, 12000, 0, b.now), b.fleet.predict(n1, 12000, 0, b.now)
        assert t0 < t1 <= 1.0
        due = list(n0.top_due)
        long = b.send(12000, 16, urgent=True, target=0.2, limit=(t0 + t1) / 2 if tight else 1.0)
        assert long is not None
        shifted = list(n0.top_due)
        b.advance(b.now + 2.0)
        assert due and len(shifted) == len(due)
        return top, long, target, [(p1 - p0, d1 - d0) for (p0, d0), (p1, d1) in zip(due, shifted, strict=True)]

    top, long, target, moved = run(tight=False)
    assert long.node == 1
    assert top.realised is not None and top.realised <= target
    assert moved == [(0.0, 0.0)]
    top, long, target, moved = run(tight=True)  # node 1 past its limit: the soonest, beside it
    assert long.node == 0
    assert top.realised is not None and top.realised > target  # (what the detour spares it)
    assert moved[0][0] > 0.0 and moved[0][1] == 0.0  # its predicted first token later, its deadline as it was


def test_another_replicas_booking_after_a_reading_does_not_shift_which_of_its_own_requests_are_waiting() -> None:
    """review18 F4: which of its requests a reading shows waiting is the newest it sent before the reading
    (vLLM's queue is FCFS), so it skipped as many of its newest as ``pending`` held — but ``pending`` also
    holds other replicas' bookings: one booked after the reading skipped this replica's newest request and
    named an older, running one waiting (``_correct`` then counts it as not started)."""
    from gpu_probe.snapshot import Snapshot

    b = Bench("8b-h100", nodes=1)
    a = b.address(0)
    b.fleet.dispatched(a, "old", 2016, 2000, 0.0)
    b.fleet.dispatched(a, "new", 2016, 2000, 0.0)
    b.fleet.booked_elsewhere(a, 2016, 2000, 0, 0.2)  # another replica's, after the reading below
    b.fleet.on_snapshot(a, Snapshot(node=a, at=0.3, ok=True, kv_usage=0.1, blocks_total=27306, block_size=16,
                                    running=1.0, waiting=1.0), 0.3, age_s=0.2)  # taken at 0.1
    assert b.fleet.nodes[a].waiting_tickets == frozenset({"new"})


def test_a_long_adapter_prompt_gathers_on_a_node_holding_its_adapter_not_on_one_it_would_load_on() -> None:
    """review47 F1: with vLLM priority levels a long less urgent prefill goes to the fullest node that still
    meets its target (best fit) — the latest predicted first token, and an adapter request's prediction
    counts a load where the node does not hold the adapter: a long one went past the idle holder (first token
    0.26 s) to load its adapter on another node (0.41 s). A holder goes first, even beside a fuller node; with
    no holder, the fullest without the load (review48 F1: ranked by the load's size, a slot wait that grows
    with a node's decoding requests, the emptiest node won)."""
    from ext_proc.nodes import Level
    from tests.test_fleets import fleet, lora_reading

    def choose(adapter: str) -> tuple[str, float | None]:
        f = fleet(3, lora={"load_seconds": 0.15})
        f.adapters = frozenset({"x", "y"})
        f.set_levels([Level(0, 0.2), Level(1, 2.0)])
        for i in range(3):
            f.on_snapshot(f"10.0.0.{i}:8000", lora_reading(["x"] if i == 0 else []), 0.0)
        f.dispatched("10.0.0.1:8000", "booked", 4016, 4000, 0.0, priority=0)  # node 1 the fullest
        f.choose(300, 0.0, prompt_tokens=200, priority=0, target=0.2)  # the top tier has traffic
        full = f.nodes["10.0.0.1:8000"]
        assert f._long(full, 12_000, f.levels[0])
        assert f.predict(full, 12_000, 1, 0.0) > max(f.predict(n, 12_000, 1, 0.0) for n in f.nodes.values()
                                                     if n is not full)
        c = f.choose(12_016, 0.0, prompt_tokens=12_000, priority=1, target=2.0, limit=5.0, adapter=adapter)
        assert c.node is not None
        return c.node.address, c.ttft

    holder, ttft = choose("x")
    assert holder == "10.0.0.0:8000"  # the holder, not the fuller node 1 that would load it
    assert ttft is not None and ttft < 0.3  # no load counted
    fullest, _ = choose("y")  # nobody holds it: the fullest
    assert fullest == "10.0.0.1:8000"

    # nobody holds it and every slot runs another adapter: a slot wait grows with a node's decoding requests,
    # and ranked by its size the emptiest node won (review48 F1) — the fullest without it goes
    f = fleet(3, lora={"load_seconds": 0.15})
    f.adapters = frozenset({"a", "z"})
    f.set_levels([Level(0, 0.2), Level(1, 2.0)])
    for i, running in enumerate((12, 1, 6)):
        f.on_snapshot(f"10.0.0.{i}:8000", lora_reading(["a"] * running, max_lora=1), 0.0)
    f.choose(300, 0.0, prompt_tokens=200, priority=0, target=0.2)
    loads = {n.address: f.lora_cost(n, "z") for n in f.nodes.values()}
    assert len(set(loads.values())) == 3 and min(loads.values()) > 0.15  # three different slot waits
    fullest = max(f.nodes.values(), key=lambda n: f.predict(n, 12_000, 1, 0.0))
    assert loads[fullest.address] != min(loads.values())
    c = f.choose(12_016, 0.0, prompt_tokens=12_000, priority=1, target=2.0, limit=5.0, adapter="z")
    assert c.node is fullest
