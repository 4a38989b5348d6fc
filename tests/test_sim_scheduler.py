"""vLLM v1 scheduling behaviour, pinned on hand-computed cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.profiles import PROFILES, Profile
from sim.engine import Engine, EngineOptions, simulate
from sim.scheduler import QueueFull, Request, Scheduler, SchedulerConfig, Status


def sched(blocks: int = 100, budget: int = 64, seqs: int = 8, policy: str = "fcfs",
          queued: int | None = None) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=blocks, block_size=4, max_num_batched_tokens=budget,
                                     max_num_seqs=seqs, policy=policy, max_num_queued_reqs=queued))  # type: ignore[arg-type]


def R(name: str, prompt: int, out: int = 4, priority: int = 0) -> Request:
    return Request(name, prompt, out, 0.0, priority)


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    s = sched(budget=64)
    r = R("a", 150, out=2)
    s.add(r)
    sizes = []
    for t in range(4):
        plan = s.schedule(float(t))
        sizes.append([n for _, n in plan.scheduled])
        events = s.finish_step(plan, float(t) + 0.5)
        if t < 2:
            assert events == []  # no token until the whole prompt is in
    assert sizes == [[64], [64], [22], [1]]
    assert r.first_token == 2.5 and r.status == Status.FINISHED


def test_running_first_then_waiting_within_the_budget() -> None:
    s = sched(budget=10)
    a, b = R("a", 6), R("b", 20)
    s.add(a)
    s.finish_step(s.schedule(0), 1)  # a's prefill: first token
    s.add(b)
    plan = s.schedule(1)
    # a decodes (1 token) first; b gets the remaining 9 of the budget as a prefill chunk
    assert [(r.id, n) for r, n in plan.scheduled] == [("a", 1), ("b", 9)]
    assert (plan.prefill_tokens, plan.decode_seqs) == (9, 1)
    assert plan.context_tokens == (6 + 1) + 9


def test_max_num_seqs_caps_running() -> None:
    s = sched(seqs=2)
    for n in "abc":
        s.add(R(n, 4))
    plan = s.schedule(0)
    assert [r.id for r, _ in plan.scheduled] == ["a", "b"]
    assert s.num_waiting == 1


def test_admission_only_when_the_whole_prompt_fits_in_free_blocks() -> None:
    s = sched(blocks=10, budget=1000)  # 10 blocks x 4 tokens
    a, b = R("a", 30, out=8), R("b", 12)
    s.add(a)
    s.add(b)
    plan = s.schedule(0)
    assert [r.id for r, _ in plan.scheduled] == ["a"]  # a takes 8 blocks, b needs 3: waits
    assert (s.used_blocks, s.free_blocks) == (8, 2)
    assert s.kv_usage == pytest.approx(0.8)


def test_block_accounting_grows_one_block_per_block_size_tokens() -> None:
    s = sched(blocks=100)
    r = R("a", 4, out=6)
    s.add(r)
    blocks = []
    t = 0.0
    while r.status != Status.FINISHED:
        s.finish_step(s.schedule(t), t + 1)
        t += 1
        blocks.append(r.blocks)
    # prompt 4 = 1 block; KV for tokens 5..8 needs a second block, 9 a third; freed at the end
    assert blocks == [1, 2, 2, 2, 2, 0]
    assert s.free_blocks == 100


def test_preemption_drops_the_newest_and_recomputes_it() -> None:
    s = sched(blocks=5, budget=100)  # 20 tokens of KV
    a, b = R("a", 8, out=6), R("b", 8, out=3)
    s.add(a)
    s.add(b)
    s.finish_step(s.schedule(0), 1)  # both prefilled: 2 blocks each
    assert s.free_blocks == 1
    plan = s.schedule(1)  # a takes the last block (KV of its token 9); b cannot grow: the newest goes
    assert [r.id for r in plan.preempted] == ["b"]
    assert [r.id for r, _ in plan.scheduled] == ["a"]
    assert b.status == Status.WAITING and b.num_computed == 0 and b.preemptions == 1
    assert s.waiting()[0] is b and s.preemptions == 1
    s.finish_step(plan, 2)
    while a.status != Status.FINISHED:
        s.finish_step(s.schedule(3), 4)
    plan = s.schedule(5)
    # b is recomputed: its prompt plus the token it had already generated
    assert plan.scheduled == [(b, 9)]


def test_no_waiting_request_is_admitted_in_a_step_with_preemption() -> None:
    s = sched(blocks=5, budget=100)
    a, b, c = R("a", 8, out=6), R("b", 8, out=3), R("c", 1)
    s.add(a)
    s.add(b)
    s.finish_step(s.schedule(0), 1)
    s.add(c)
    plan = s.schedule(1)
    assert plan.preempted and c.status == Status.WAITING


def test_priority_policy_orders_waiting_and_preempts_the_least_important() -> None:
    s = sched(blocks=100, seqs=1, policy="priority")
    low, high, mid = R("low", 4, priority=5), R("high", 4, priority=0), R("mid", 4, priority=2)
    for r in (low, high, mid):
        s.add(r)
    assert [r.id for r in s.waiting()] == ["high", "mid", "low"]
    assert [r.id for r, _ in s.schedule(0).scheduled] == ["high"]

    p = sched(blocks=5, budget=100, policy="priority")
    first, second = R("first", 8, out=6, priority=0), R("second", 8, out=3, priority=9)
    p.add(second)
    p.add(first)
    p.finish_step(p.schedule(0), 1)
    plan = p.schedule(1)
    assert [r.id for r in plan.preempted] == ["second"]  # lower priority goes, not the newest


def test_max_num_queued_reqs() -> None:
    s = sched(queued=2)
    s.add(R("a", 1))
    s.add(R("b", 1))
    with pytest.raises(QueueFull):
        s.add(R("c", 1))


def test_a_request_larger_than_the_whole_cache_is_refused() -> None:
    s = sched(blocks=10)
    with pytest.raises(ValueError, match="KV cache"):
        s.add(R("a", 30, out=20))


def test_abort_frees_blocks() -> None:
    s = sched(blocks=10)
    r = R("a", 20)
    s.add(r)
    s.schedule(0)
    assert s.free_blocks == 5
    s.abort(r)
    assert s.free_blocks == 10 and not s.running and r.status == Status.ABORTED


def small(profile: str = "8b-h100") -> Profile:
    return PROFILES[profile]


def test_step_time_model_at_batch_one_matches_the_formula() -> None:
    p = small()
    e = Engine(p)
    [r] = simulate(e, [Request("a", 1000, 11, 0.0)])
    prefill_s = p.step_ms(1000, 0, 1000) / 1000
    decode_s = sum(p.step_ms(0, 1, 1000 + k + 1) for k in range(10)) / 1000
    assert r.first_token == pytest.approx(prefill_s)
    assert r.finished_at == pytest.approx(prefill_s + decode_s)
    tpot = (r.finished_at - r.first_token) / 10  # type: ignore[operator]
    assert tpot == pytest.approx(p.step_ms(0, 1, 1005.5) / 1000, rel=1e-3)


def test_saturation_tpot_follows_the_batch_term() -> None:
    p = small()
    n = 64
    e = Engine(p)
    reqs = simulate(e, [Request(str(i), 100, 50, 0.0) for i in range(n)])
    r = reqs[0]
    tpot = (r.finished_at - r.first_token) / 49  # type: ignore[operator]
    ctx = n * (100 + 25)
    assert tpot == pytest.approx(p.step_ms(0, n, ctx) / 1000, rel=0.02)


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40), st.floats(0, 2), st.integers(0, 3)),
                  min_size=1, max_size=40),
    blocks=st.integers(80, 200), budget=st.integers(16, 512), policy=st.sampled_from(["fcfs", "priority"]),
)
def test_every_request_ends_exactly_once_and_blocks_never_overflow(
        reqs: list[tuple[int, int, float, int]], blocks: int, budget: int, policy: str) -> None:
    p = small()
    e = Engine(p, EngineOptions(policy=policy, num_gpu_blocks=blocks, max_num_batched_tokens=budget))  # type: ignore[arg-type]
    outputs: dict[str, int] = {}
    finished: list[str] = []

    def tokens(events: list, at: float) -> None:  # type: ignore[type-arg]
        sch = e.scheduler
        assert 0 <= sch.free_blocks <= blocks
        assert sum(r.blocks for r in sch.running) == sch.used_blocks
        for ev in events:
            outputs[ev.request.id] = outputs.get(ev.request.id, 0) + 1
            if ev.finished:
                finished.append(ev.request.id)

    e.on_tokens = tokens
    # 16-token blocks: keep every request small enough to fit on its own
    arrivals = [Request(str(i), min(pr, blocks * 16 - 64), out, t, prio) for i, (pr, out, t, prio) in enumerate(reqs)]
    simulate(e, arrivals)
    assert sorted(finished) == sorted(r.id for r in arrivals)  # all end, none twice
    assert all(outputs[r.id] == r.max_tokens for r in arrivals)  # each token emitted once
    assert e.scheduler.free_blocks == blocks and not e.scheduler.has_work()


def test_fleet_simulation_is_deterministic_and_loses_nothing() -> None:
    from kvgate.bench.overhead import sim_speed

    a = sim_speed(seconds=20, nodes=2, rate=20, quiet=True)
    b = sim_speed(seconds=20, nodes=2, rate=20, quiet=True)
    assert a["requests"] > 300 and a["finished"] == a["requests"]
    assert (a["steps"], a["tokens"], a["ttft_p99_s"]) == (b["steps"], b["tokens"], b["ttft_p99_s"])


def test_fleet_routes_to_the_least_loaded_node() -> None:
    from sim.fleet import simulate_fleet

    engines = [Engine(small()) for _ in range(3)]
    reqs = [Request(str(i), 100, 200, 0.0) for i in range(9)]
    simulate_fleet(engines, reqs)
    assert all(e.steps > 0 for e in engines)
    assert all(r.finished_at is not None for r in reqs)


def test_exported_gauges_read_the_scheduler_state() -> None:
    from sim.metrics import NodeMetrics

    e = Engine(small(), EngineOptions(num_gpu_blocks=40, max_num_seqs=1))
    m = NodeMetrics(e, "m")
    labels = {"model_name": "m", "engine": "0"}
    e.add(Request("a", 100, 5, 0.0))  # 7 blocks of 16
    e.add(Request("b", 10, 5, 0.0))
    dt = e.begin_step(0.0)
    assert dt is not None
    e.end_step(dt)
    val = m.registry.get_sample_value
    assert val("vllm:kv_cache_usage_perc", labels) == pytest.approx(7 / 40)
    assert val("vllm:num_requests_running", labels) == 1
    assert val("vllm:num_requests_waiting", labels) == 1
    assert val("vllm:prompt_tokens_total", labels) == 100
    assert val("vllm:generation_tokens_total", labels) == 1
    assert val("vllm:time_to_first_token_seconds_count", labels) == 1
    assert val("vllm:cache_config_info", {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
                                          "engine": "0", "gpu_memory_utilization": "0.9",
                                          "num_gpu_blocks": "40"}) == 1


def _lpt(threshold: int, budget: int = 64, policy: str = "fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=200, block_size=4, max_num_batched_tokens=budget, max_num_seqs=8,
                                     policy=policy, long_prefill_token_threshold=threshold))  # type: ignore[arg-type]


def test_long_prefill_token_threshold_caps_one_requests_tokens_per_step() -> None:
    """vLLM v1's ``--long-prefill-token-threshold``: a prompt gets at most that many tokens a step, running
    or newly admitted, and the rest of the budget goes to the requests behind it in the same step."""
    s = _lpt(16)
    long, short = R("long", 40, out=1), R("short", 10, out=1)
    s.add(long)
    s.add(short)
    plan = s.schedule(0)
    assert [(r.id, n) for r, n in plan.scheduled] == [("long", 16), ("short", 10)]
    s.finish_step(plan, 1)
    assert short.first_token == 1 and long.first_token is None  # the short one no longer waits for it
    sizes = []
    for t in range(1, 4):
        plan = s.schedule(float(t))
        sizes.append([(r.id, n) for r, n in plan.scheduled])
        s.finish_step(plan, t + 1.0)
    assert sizes == [[("long", 16)], [("long", 8)], []]
    assert long.first_token == 3


def test_without_the_threshold_a_long_prompt_takes_the_whole_budget() -> None:
    s = _lpt(0)
    long, short = R("long", 70, out=1), R("short", 10, out=1)
    s.add(long)
    s.add(short)
    assert [(r.id, n) for r, n in s.schedule(0).scheduled] == [("long", 64)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 120), st.integers(1, 6)), min_size=1, max_size=12),
       st.integers(1, 40), st.sampled_from(["fcfs", "priority"]))
def test_no_request_gets_more_than_the_threshold_in_a_step(reqs: list[tuple[int, int]], threshold: int,
                                                          policy: str) -> None:
    s = _lpt(threshold, policy=policy)
    added = [Request(f"r{i}", prompt, out, 0.0, i % 3) for i, (prompt, out) in enumerate(reqs)]
    for r in added:
        s.add(r)
    t = 0.0
    while s.has_work():
        plan = s.schedule(t)
        assert plan.tokens <= 64
        assert all(n <= threshold for _, n in plan.scheduled)
        t += 1.0
        s.finish_step(plan, t)
        assert t < 2000
    assert all(r.status is Status.FINISHED for r in added)
