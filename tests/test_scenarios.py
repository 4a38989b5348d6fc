"""The benchmark scenarios: trace format, determinism, accounting, baselines that are what they claim,
and kvgate's own core (quotas, breakers, the scaler's law) acting inside virtual time."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from ext_proc.config import ConfigError, parse_config
from ext_proc.profiles import get_profile
from kvgate.bench.scenarios import report
from kvgate.bench.scenarios.driver import Autoscaling, Policy, Run, simulate
from kvgate.bench.scenarios.runner import ScenarioResult, run
from kvgate.bench.scenarios.trace import TraceError, TraceRequest, read_trace, write_trace
from kvgate.bench.scenarios.workloads import PLACEHOLDER_NODES, SCENARIOS, get_scenario

NODES = {"static": [{"address": "node-0:8000", "probe": "http://node-0:9102"}]}



# -- the trace format --------------------------------------------------------------------------------

def test_a_trace_round_trips(tmp_path: Path) -> None:
    reqs = [TraceRequest(0.5, "a", 100, 20, True, 64), TraceRequest(0.1, "b", 3000, 200)]
    f = tmp_path / "t.jsonl"
    assert write_trace(f, reqs) == 2
    assert read_trace(f) == sorted(reqs, key=lambda r: r.t)


def test_bad_lines_are_reported_with_their_numbers(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join([
        '{"t": 0, "tenant": "a", "prompt_tokens": 10, "output_tokens": 5}',
        "# a comment",
        '{"t": -1, "tenant": "a", "prompt_tokens": 10, "output_tokens": 5}',
        "not json",
        '{"t": 1, "tenant": "a", "prompt_tokens": 10, "output_tokens": 5, "max_tokens": 2}',
        '{"t": 1, "tenant": "", "prompt_tokens": 10, "output_tokens": 5}',
        '{"t": 1, "tenant": "a", "prompt_tokens": 1.5, "output_tokens": 5, "colour": "red"}',
        "[1, 2]",
    ]))
    with pytest.raises(TraceError) as e:
        read_trace(f)
    msg = str(e.value)
    assert "6 bad line(s)" in msg
    for needle in ("line 3: t: must be a number of seconds >= 0", "line 4: not JSON",
                   "line 5: max_tokens: must be at least 5", "line 6: tenant: must be a non-empty string",
                   "line 7: unknown field(s): colour", "line 8: must be a JSON object"):
        assert needle in msg
    assert "line 1" not in msg and "line 2" not in msg
    empty = tmp_path / "empty.jsonl"
    empty.write_text("# nothing\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(empty)


# -- the runner --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_scenario_is_deterministic_and_accounts_for_every_request(name: str) -> None:
    sc = get_scenario(name)
    a = run(sc, scale=0.15)
    b = run(get_scenario(name), scale=0.15)
    assert a.to_json() == b.to_json()
    assert len({s.label for s in a.summaries}) == len(a.summaries) >= 3
    for s in a.summaries:
        g = s.all
        # the ideal row is offered what its Ideal keeps of the trace (noisy-neighbour: the chat tenants)
        offered = len(sc.ideal.offered(a.config, sc.trace(0.15))) if s.ideal and sc.ideal else a.requests
        assert s.result.lost == 0 and g.offered == offered
        assert g.admitted + g.rejected_policy + g.rejected_capacity + g.rejected_other == g.offered
        assert all(o.e2e is not None and o.ttft is not None for o in s.result.outcomes if o.status == 200)
        assert s.gpu_hours > 0


def test_the_trace_depends_on_the_seed() -> None:
    sc = get_scenario("noisy-neighbour")
    assert sc.trace(0.1) == sc.trace(0.1)
    assert replace(sc, seed=2).trace(0.1) != sc.trace(0.1)


def test_the_baselines_are_what_they_claim() -> None:
    sums = {s.result.policy.name: s for s in run(get_scenario("noisy-neighbour"), scale=0.2).summaries}
    assert sums["none"].all.admitted == sums["none"].all.offered  # no admission: nothing is ever rejected
    assert sums["kv-shed"].all.rejected_policy == 0 and sums["kv-shed"].all.rejected_capacity > 0  # no tenants
    kv = sums["kvgate"]
    assert kv.tenants["rag"].rejected_policy > 0  # the flooding tenant meets its own quota...
    assert kv.tenants["chat-a"].rejected_policy == 0  # ...and nobody else does
    auto = {s.result.policy.name: s for s in run(get_scenario("diurnal"), scale=0.3).summaries}
    assert auto["autoscale-only"].all.admitted == auto["autoscale-only"].all.offered
    assert len(auto["autoscale-only"].result.node_timeline) > 1  # it did scale


def test_quotas_in_virtual_time_are_kvgates_own() -> None:
    cfg = parse_config({"tenants": [{"name": "a", "requests_per_minute": 1, "request_burst": 3},
                                    {"name": "b"}], "nodes": NODES})
    trace = [TraceRequest(i * 0.1, t, 100, 10) for i in range(10) for t in ("a", "b")]
    r = simulate(cfg, Policy("kvgate", 1, "kvgate"), get_profile("8b-h100"), trace)
    by = {(o.req.tenant, o.status, o.reason) for o in r.outcomes}
    assert sum(1 for o in r.outcomes if o.req.tenant == "a" and o.status == 200) == 3  # the burst
    assert ("a", 429, "tenant-requests") in by and not any(t == "b" and s != 200 for t, s, _ in by)
    unknown = simulate(cfg, Policy("kvgate", 1, "kvgate"), get_profile("8b-h100"), [TraceRequest(0, "zed", 10, 1)])
    assert unknown.outcomes[0].status == 401  # a tenant the config lacks is an unknown API key


def test_the_breaker_ejects_the_slowed_node_and_only_it() -> None:
    sc = get_scenario("overload")
    cfg = parse_config(sc.config)
    kvgate = next(p for p in sc.policies if p.name == "kvgate")
    scale = 0.3
    rn = Run(cfg, kvgate, get_profile(sc.profile), sc.trace(scale), sc.seed,
             degrade=tuple(replace(d, at=d.at * scale) for d in sc.degrade))
    rn.run()
    opened = [(t, node) for t, node, _, new, _ in rn.transitions if new == "open"]
    assert opened and {node for _, node in opened} == {"node-0:8000"}
    assert opened[0][0] > sc.degrade[0].at * scale  # not before it slowed down


def test_the_scaler_adds_nodes_on_capacity_rejections() -> None:
    # at 0.3 of the day the queue absorbs the peak now that no tier waits behind another's head
    sums = {s.result.policy.name: s for s in run(get_scenario("diurnal"), scale=0.5).summaries}
    timeline = sums["kvgate+scaler"].result.node_timeline
    assert max(c for _, c in timeline) >= 4  # from one node (+1 warm) up in steps
    assert sums["kvgate+scaler"].avg_gpus < sums["none"].avg_gpus


# -- the ideal reference rows ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def at_tenth() -> dict[str, ScenarioResult]:
    return {n: run(get_scenario(n), scale=0.1) for n in SCENARIOS}


def test_disturbed_scenarios_have_an_ideal_row_and_diurnal_has_none(at_tenth: dict[str, ScenarioResult]) -> None:
    for name, nodes in (("noisy-neighbour", 2), ("overload", 3)):
        res = at_tenth[name]
        ideal = [s for s in res.summaries if s.ideal]
        assert [s.label for s in ideal] == [f"ideal ({nodes} nodes)"] and res.summaries[-1] is ideal[0]
        assert ideal[0].result.policy.admission == "none" and ideal[0].result.breaker_opens == 0
        entries = res.to_json()["policies"]
        assert [e["ideal"] for e in entries] == [False] * (len(entries) - 1) + [True]
        assert entries[-1]["policy"] == f"ideal ({nodes} nodes)" and entries[-1]["ideal_scope"]["nodes"] == nodes
        assert f"| ideal ({nodes} nodes)" in res.markdown() and "*ideal (" in res.markdown()
    diurnal = at_tenth["diurnal"]
    assert get_scenario("diurnal").ideal is None
    assert not any(s.ideal for s in diurnal.summaries) and "ideal" not in diurnal.markdown()
    assert all(e["ideal"] is False for e in diurnal.to_json()["policies"])


def test_the_overload_ideal_takes_the_slowed_node_out_exactly_while_it_is_slow(
        at_tenth: dict[str, ScenarioResult]) -> None:
    sc = get_scenario("overload")
    assert sc.ideal is not None
    slow, healthy = sc.degrade  # the outage is the disturbance's window, on its node
    (out,) = sc.ideal.out
    assert (out.node, out.start, out.end) == (slow.node, slow.at, healthy.at) and healthy.factor == 1.0
    res = at_tenth["overload"]
    ideal = next(s for s in res.summaries if s.ideal)
    start, end = out.start * 0.1, out.end * 0.1  # scaled as degrade is
    assert res.to_json()["policies"][-1]["ideal_scope"]["out"] == [{"node": 0, "start": start, "end": end}]
    to_0 = [o.decided_at for o in ideal.result.outcomes if o.node == 0 and o.decided_at is not None]
    assert len(to_0) == sum(1 for o in ideal.result.outcomes if o.node == 0) > 0
    assert all(not start <= t < end for t in to_0)
    assert any(t < start for t in to_0) and any(t >= end for t in to_0)  # out only for the window
    assert ideal.all.admitted == ideal.all.offered == res.requests  # the whole trace, on the other nodes
    during = {o.node for o in ideal.result.outcomes if o.decided_at is not None and start <= o.decided_at < end}
    assert during == {1, 2}
    # and node 0 is never slowed in it: the row is the same run as one without any degrade event
    plain = simulate(res.config, sc.ideal.policy, get_profile(sc.profile), sc.trace(0.1), sc.seed,
                     autoscaling=sc.autoscaling, outages=sc.ideal.scaled(0.1))
    assert [(o.node, o.ttft, o.e2e) for o in plain.outcomes] == [(o.node, o.ttft, o.e2e) for o in ideal.result.outcomes]


def test_the_json_of_a_single_scenario_run_carries_the_ideal_row() -> None:
    r = kvgate("bench", "scenarios", "--scenario", "overload", "--scale", "0.05", "--json")
    assert r.returncode == 0, r.stderr
    (doc,) = json.loads(r.stdout)
    assert [(e["policy"], e["ideal"]) for e in doc["policies"]] == [
        ("none (3 nodes)", False), ("kv-shed (3 nodes)", False), ("kvgate (3 nodes)", False),
        ("ideal (3 nodes)", True)]
    assert all(sum(e["breaker_opens_by_cause"].values()) == e["breaker_opens"] for e in doc["policies"])


def test_outages_are_for_plain_least_request_only() -> None:
    from kvgate.bench.scenarios.driver import Outage

    cfg = parse_config({"tenants": [{"name": "a"}], "nodes": NODES})
    with pytest.raises(ValueError, match="least-request"):
        Run(cfg, Policy("kvgate", 2, "kvgate"), get_profile("8b-h100"), [TraceRequest(0, "a", 10, 1)],
            outages=(Outage(0, 1, 0),))
    trace = [TraceRequest(i * 0.1, "a", 10, 1) for i in range(10)]
    r = simulate(cfg, Policy("none", 1), get_profile("8b-h100"), trace, outages=(Outage(0.25, 0.55, 0),))
    refused = [o.req.t for o in r.outcomes if o.status == 503]  # the only node out: nowhere to go
    assert refused == pytest.approx([0.3, 0.4, 0.5]) and all(o.reason == "no-node" for o in r.outcomes
                                                            if o.status == 503)


def test_the_noisy_neighbour_ideal_offers_only_the_interactive_tenants(at_tenth: dict[str, ScenarioResult]) -> None:
    res = at_tenth["noisy-neighbour"]
    ideal = next(s for s in res.summaries if s.ideal)
    top = res.config.top_tier
    chat = {t.name for t in res.config.tenants if t.tier == top}
    assert chat == {"chat-a", "chat-b"}
    assert ideal.result.outcomes and {o.req.tenant for o in ideal.result.outcomes} == chat  # no RAG request
    n_chat = sum(1 for r in get_scenario("noisy-neighbour").trace(0.1) if r.tenant in chat)
    assert ideal.all.offered == n_chat < res.requests
    # the removed tenant is absent, not reported as 0% served; the figures are over the chat tenants
    assert set(ideal.tenants) == chat and set(ideal.tiers) == {top} and "rag" not in ideal.served_tokens
    assert ideal.all.slo == ideal.tiers[top].slo is not None
    entry = res.to_json()["policies"][-1]
    assert "rag" not in entry["tenants"] and entry["ideal_scope"]["not_offered"] == ["rag"]
    assert "| ideal (2 nodes)   | rag" not in res.markdown()


def test_an_ideal_offered_nothing_reports_no_figures_and_divides_by_nothing() -> None:
    from kvgate.bench.scenarios.workloads import SHORT, Ideal, Scenario, Stream, const

    sc = Scenario("quiet", "quiet", "", "8b-h100", 20.0,
                  {"tenants": [{"name": "app", "tier": "standard"}], "nodes": NODES},
                  (Policy("none", 1),), (Stream("app", SHORT, const(1.0)),),
                  ideal=Ideal(1, tiers=("interactive",)))
    res = run(sc)
    ideal = res.summaries[-1]
    assert ideal.ideal and ideal.all.offered == 0 and ideal.all.slo is None and ideal.all.ttft == (None,) * 3
    assert ideal.goodput == 0 and ideal.goodput_per_gpu == 0 and not ideal.tenants
    assert "| ideal (1 nodes)" in res.markdown() and res.to_json()["policies"][-1]["ideal_scope"]["tenants"] == []


def test_breaker_opens_are_counted_by_cause(at_tenth: dict[str, ScenarioResult]) -> None:
    opened = 0
    for res in at_tenth.values():
        for s, e in zip(res.summaries, res.to_json()["policies"], strict=True):
            by = e["breaker_opens_by_cause"]
            assert set(by) == {"latency", "kv", "trial"} and sum(by.values()) == e["breaker_opens"]
            assert by == s.breaker_opens_by_cause
            opened += e["breaker_opens"]
    assert opened > 0  # the overload's slowed node trips kvgate's breaker even at a tenth of the run
    kvgate_row = next(s for s in at_tenth["overload"].summaries if s.result.policy.name == "kvgate")
    assert kvgate_row.breaker_opens_by_cause["latency"] > 0  # node 0 is slow, not full
    assert "breaker opens (lat/kv/trial)" in at_tenth["overload"].markdown()


# -- the report --------------------------------------------------------------------------------------

def test_max_min_fair_shares_and_jain() -> None:
    shares = report.max_min_shares({"a": 10, "b": 100, "c": 100}, {"a": 1, "b": 1, "c": 2}, 100)
    assert shares["a"] == 10 and shares["b"] == pytest.approx(30) and shares["c"] == pytest.approx(60)
    assert report.jain([1, 1, 1]) == pytest.approx(1.0)
    assert report.jain([1, 0, 0]) == pytest.approx(1 / 3)
    assert report.percentile([3, 1, 2, 4], 50) == 2 and report.percentile([], 99) is None


# -- the commands ------------------------------------------------------------------------------------

def kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True, timeout=300)


def test_trace_and_replay_commands(tmp_path: Path) -> None:
    trace = tmp_path / "nn.jsonl"
    r = kvgate("bench", "trace", "--scenario", "noisy-neighbour", "--scale", "0.1", "--out", str(trace))
    assert r.returncode == 0 and "written" in r.stdout
    lines = trace.read_text().splitlines()
    assert lines and {"t", "tenant", "prompt_tokens", "output_tokens", "stream"} <= set(json.loads(lines[0]))
    cfg = tmp_path / "bench.yaml"
    cfg.write_text(yaml.safe_dump({
        "profile": "34b-a100", "nodes": 2, "policies": ["none", "kvgate"],
        "kvgate": {"tenants": [{"name": "chat-a", "tier": "interactive"}, {"name": "chat-b"},
                               {"name": "rag", "max_concurrent": 1}]}}))
    out = tmp_path / "out"
    r = kvgate("bench", "scenarios", "--trace", str(trace), "--config", str(cfg), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "| none (2 nodes)" in r.stdout and "| kvgate (2 nodes)" in r.stdout
    assert (out / "report.md").is_file() and (out / "nn-latency-cdf.png").stat().st_size > 1000
    doc = json.loads((out / "results.json").read_text())
    # a trace run has an ideal row too: the interactive tier alone on the static fleet
    assert [p["policy"] for p in doc[0]["policies"]] == ["none (2 nodes)", "kvgate (2 nodes)", "ideal (2 nodes)"]
    assert doc[0]["policies"][2]["ideal"] and doc[0]["policies"][2]["ideal_scope"]["tenants"] == ["chat-a"]
    assert doc[0]["policies"][1]["tenants"]["rag"]["rejected_429"] > 0


def test_bad_inputs_to_the_commands(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1}\n{"t": "soon"}\n')
    cfg = tmp_path / "bench.yaml"
    cfg.write_text("profile: 8b-h100\n")
    r = kvgate("bench", "scenarios", "--trace", str(bad), "--config", str(cfg))
    assert r.returncode == 2 and "line 2: " in r.stderr
    r = kvgate("bench", "scenarios", "--trace", str(bad))
    assert r.returncode == 2 and "--trace needs --config" in r.stderr
    cfg.write_text("profile: 9b-tpu\nnodes: 0\n")
    r = kvgate("bench", "scenarios", "--trace", str(bad), "--config", str(cfg))
    assert r.returncode == 2 and "nodes: Input should be greater than or equal to 1" in r.stderr
    cfg.write_text("profile: 9b-tpu\n")
    r = kvgate("bench", "scenarios", "--trace", str(bad), "--config", str(cfg))
    assert r.returncode == 2 and "unknown profile '9b-tpu'" in r.stderr
    cfg.write_text("kvgate: {tenants: [{name: a, tier: gold}]}\n")
    r = kvgate("bench", "scenarios", "--trace", str(bad), "--config", str(cfg))
    assert r.returncode == 2 and "kvgate: " in r.stderr and "tenants[0].tier" in r.stderr


def test_live_and_virtual_time_agree_on_the_decisions(tmp_path: Path) -> None:
    """A few seconds through the real stack (Envoy, kvgate, probes, two sim nodes) and the same trace in
    virtual time: the same requests are admitted and refused, and both see every first token."""
    from kvgate.bench.scenarios.live import run_live
    from kvgate.bench.scenarios.workloads import SHORT, Scenario, Stream, const

    sc = Scenario("tiny", "tiny", "", "8b-h100", 20.0,
                  {"tenants": [{"name": "app", "tier": "interactive"},
                               {"name": "capped", "requests_per_minute": 1, "request_burst": 2}],
                   "nodes": NODES},
                  (Policy("kvgate", 2, "kvgate"),),
                  (Stream("app", SHORT, const(3.0)), Stream("capped", SHORT, const(1.0))))
    live, virtual = run_live(sc, 4.0, tmp_path / "live")
    assert live.result.lost == 0 and live.all.offered == virtual.all.offered > 5
    assert live.tenants["capped"].admitted == virtual.tenants["capped"].admitted == 2  # the burst, both sides
    assert live.all.admitted == virtual.all.admitted
    assert live.all.ttft[0] is not None and virtual.all.ttft[0] is not None


def test_a_trace_with_epoch_timestamps_replays_from_its_first_request(tmp_path: Path) -> None:
    """Absolute timestamps (seconds since 1970) once made the rejections plot allocate a bin per second
    since the epoch; times now count from the first request."""
    from kvgate.bench.scenarios.runner import BenchConfig, from_trace

    trace = tmp_path / "epoch.jsonl"
    t0 = 1_764_000_000.0
    trace.write_text("".join(json.dumps({"t": t0 + i * 0.5, "tenant": "a", "prompt_tokens": 100,
                                         "output_tokens": 10, "stream": False}) + "\n" for i in range(20)))
    sc, reqs = from_trace(trace, BenchConfig(policies=["none"], kvgate={"tenants": [{"name": "a"}]}))
    assert reqs[0].t == 0.0 and reqs[-1].t == 9.5 and sc.duration_s == 9.5
    res = run(sc, reqs)
    assert res.summaries[0].result.duration_s < 60


def test_a_bench_config_sets_the_autoscalers_start_size_and_the_scaler_law(tmp_path: Path) -> None:
    from kvgate.bench.scenarios.runner import BenchConfig, load_bench_config

    cfg = tmp_path / "bench.yaml"
    cfg.write_text(yaml.safe_dump({
        "nodes": 3, "min_nodes": 2, "max_nodes": 9, "policies": ["autoscale-only", "kvgate+scaler"],
        "scaler": {"step": 3, "scale_up_threshold": 0.1, "cooldown_s": 30, "warm_pool": 1, "window_s": 20,
                   "scale_down_window_s": 600, "law_scale_down_window_s": 90, "law_behind_hpa": False},
        "kvgate": {"tenants": [{"name": "a"}]}}))
    bc = load_bench_config(cfg)
    assert [(p.nodes, p.min_nodes, p.max_nodes) for p in bc.policy_list()] == [(3, 2, 9), (3, 2, 9)]
    auto = bc.autoscaling()
    assert (auto.law.step, auto.law.scale_up_threshold, auto.law.cooldown_s, auto.law.warm_pool,
            auto.window_s) == (3, 0.1, 30, 1, 20)
    # each autoscaler its own scale-down window: the HPA's stabilisation, the law's peak lookback
    assert (auto.scale_down_window_s, auto.law.scale_down_window_s) == (600, 90)
    assert not auto.law_behind_hpa and BenchConfig().autoscaling().law_behind_hpa  # (the chart's HPA by default)
    assert Autoscaling().law_behind_hpa and get_scenario("diurnal").autoscaling.law_behind_hpa
    cfg.write_text(yaml.safe_dump({"scaler": {"stepp": 3}}))
    with pytest.raises(ConfigError, match=r"scaler\.stepp"):
        load_bench_config(cfg)


def test_kvgate_scaler_can_run_behind_the_charts_hpa(tmp_path: Path) -> None:
    """``scaler.law_behind_hpa``: the law's count goes through the HPA the chart renders — Kubernetes' 10%
    tolerance (11 of 10 ignored, 12 applied), up at once, down one pod per 15 s to the highest count asked
    over the cooldown — rather than straight to the fleet."""
    from kvgate.bench.scenarios.driver import PoolSize
    from kvgate.bench.scenarios.hpa import Hpa, chart_metric
    from kvgate.bench.scenarios.runner import BenchConfig, from_trace

    # a burst of 1,500-token prompts for 90 s, then a trickle: the law scales 1 -> 6 and back down a node a
    # cooldown (60 s) apart; behind the HPA each scale-down lands when the count asked has been lower for a
    # whole cooldown (its stabilisation window), later, to the same end
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(json.dumps({"t": round(i / 60.0, 3), "tenant": "a", "prompt_tokens": 1500,
                                         "output_tokens": 64}) + "\n" for i in range(90 * 60)) +
                     "".join(json.dumps({"t": 90.0 + i / 2.0, "tenant": "a", "prompt_tokens": 1500,
                                         "output_tokens": 64}) + "\n" for i in range(780)))
    timelines = {}
    for on in (False, True):
        bc = BenchConfig(nodes=1, max_nodes=8, policies=["kvgate+scaler"], kvgate={
            "tenants": [{"name": "a"}], "nodes": PLACEHOLDER_NODES}, scaler={
            "cooldown_s": 60, "law_scale_down_window_s": 0, "law_behind_hpa": on})
        sc, reqs = from_trace(trace, bc)
        r = Run(parse_config(sc.config), sc.policies[0], get_profile(sc.profile), reqs, autoscaling=sc.autoscaling)
        (pool,) = r.pools.values()
        assert (pool.hpa is not None) == on  # (with the key false: no HPA, the law's count as it is)
        assert pool.law is not None and pool.law.s.hpa_tolerance == (0.1 if on else 0.0)  # (no tolerance to clear)
        r.run()
        timelines[on] = r.node_timeline
    downs = {on: [t for (t, n), (_, m) in zip(tl[1:], tl, strict=False) if n < m] for on, tl in timelines.items()}
    assert max(n for _, n in timelines[False]) == max(n for _, n in timelines[True]) >= 4
    assert len(downs[True]) == len(downs[False]) >= 3 and timelines[True][-1][1] == timelines[False][-1][1]
    assert all(b >= a + 30 for a, b in zip(downs[False], downs[True], strict=True)), downs

    hpa = Hpa(sc.autoscaling.chart_hpa(PoolSize("p", 10, 1, 16)))

    def ask(now: float, current: int, law: int) -> int:
        return hpa.decide(now, current, chart_metric(law, current, hpa.settings.tolerance))

    assert ask(0.0, 10, 11) == 10 and ask(15.0, 10, 12) == 12  # within 10%: ignored; past it: at once
    assert Hpa(sc.autoscaling.chart_hpa(PoolSize("p", 2, 1, 16))).decide(0.0, 2, 16) == 16  # (the chart's: all at once)
    assert [ask(t, 12, 9) for t in (30.0, 60.0)] == [12, 12]  # down: the highest count of the cooldown (60 s)
    assert ask(90.0, 12, 9) == 11  # ... then one pod per 15 s


def test_a_bench_config_runs_its_nodes_with_a_long_prefill_token_threshold(tmp_path: Path) -> None:
    """``long_prefill_token_threshold`` in a bench config: the simulated nodes cap a prompt's tokens per step
    (a short prompt behind a long one gets its first token sooner) and kvgate's prior is told the same."""
    from kvgate.bench.scenarios.runner import BenchConfig, from_trace

    trace = tmp_path / "long-then-short.jsonl"
    trace.write_text("".join(json.dumps({"t": t, "tenant": "a", "prompt_tokens": p, "output_tokens": 4,
                                         "stream": False}) + "\n" for t, p in ((0.0, 8000), (0.001, 50))))
    ttft = {}
    for threshold in (0, 1024):
        bc = BenchConfig(nodes=1, policies=["none", "kvgate"],
                         kvgate={"tenants": [{"name": "a"}], "nodes": PLACEHOLDER_NODES},
                         long_prefill_token_threshold=threshold)
        sc, reqs = from_trace(trace, bc)
        kvgate = Run(parse_config(sc.config), sc.policies[1], get_profile(sc.profile), reqs, engine=sc.engine_options())
        assert kvgate.nodes[0].engine.scheduler.cfg.long_prefill_token_threshold == threshold
        assert kvgate.config.nodes is not None
        assert kvgate.config.nodes.performance.long_prefill_token_threshold == threshold
        res = run(sc, reqs)
        ttft[threshold] = res.summaries[0].result.outcomes[1].ttft
    assert ttft[1024] is not None and ttft[0] is not None and ttft[1024] < ttft[0] / 2
