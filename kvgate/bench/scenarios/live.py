"""``kvgate bench live``: the start of a scenario through the real stack — Envoy, kvgate, probes and
simulated vLLM nodes as processes, in real time — beside the same trace in virtual time, in one table.

Both sides replay one trace with the scenario's kvgate config and fleet size. Every request streams (so
the client sees its first token) and asks for exactly the tokens it will get (``ignore_eos``), so the
reservation is the real usage on both sides. Scenario events (a node slowing down) and autoscaling
are virtual-time only; the live run uses the scenario's first kvgate policy on a static fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import time
from dataclasses import replace
from typing import Any

import aiohttp

from ext_proc.config import parse_config
from ext_proc.identity import hash_key
from ext_proc.profiles import get_profile

from ...dev.stack import Stack
from . import report
from .driver import Outcome, RunResult, simulate
from .workloads import Scenario, get_scenario

REQUEST_TIMEOUT_S = 300.0


def _key(tenant: str) -> str:
    return f"sk-bench-{tenant}"


def live_config(sc: Scenario) -> dict[str, Any]:
    """The scenario's kvgate config with an API key per tenant (the live side authenticates)."""
    cfg: dict[str, Any] = json.loads(json.dumps(sc.config))
    for t in cfg.get("tenants", []):
        t["api_key_sha256"] = [hash_key(_key(t["name"]))]
    cfg.pop("nodes", None)  # the stack lists its own nodes
    return cfg


_SEQ = itertools.count()


async def _one(session: aiohttp.ClientSession, url: str, model: str, o: Outcome, t0: float) -> None:
    r = o.req
    await asyncio.sleep(max(0.0, t0 + r.t - time.monotonic()))
    # token ids, one of its own first: like virtual time (a request without segments shares nothing),
    # no node answers it from its prefix cache
    body = {"model": model, "prompt": [1000 + next(_SEQ)] + [7] * (r.prompt_tokens - 1),
            "max_tokens": r.output_tokens, "ignore_eos": True, "stream": True}
    start = t0 + r.t
    try:
        async with session.post(url, json=body, headers={"authorization": f"Bearer {_key(r.tenant)}"},
                                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
            o.decided_at = time.monotonic() - t0
            if resp.status != 200:
                await resp.read()
                o.status, o.reason = resp.status, resp.headers.get("x-kvgate-reject-reason", "")
                o.klass = {429: "policy", 503: "capacity"}.get(resp.status, "invalid")
                return
            async for line in resp.content:
                if o.ttft is None and line.startswith(b"data: {"):
                    o.ttft = time.monotonic() - start
            o.e2e = time.monotonic() - start
            o.status = 200
    except (aiohttp.ClientError, TimeoutError) as e:
        o.reason = f"client: {type(e).__name__}"  # status stays 0: lost


async def _replay(url: str, model: str, outcomes: list[Outcome]) -> float:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(_one(session, url, model, o, t0) for o in outcomes))
        return time.monotonic() - t0


def _breaker_opens(metrics_url: str) -> int:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "kvgate_node_breaker_transitions_total" and s.labels.get("to") == "open"))


def run_live(sc: Scenario, seconds: float, workdir: Any) -> tuple[report.Summary, report.Summary]:
    """(live, virtual) summaries of the first ``seconds`` of the scenario's trace."""
    policy = next(p for p in sc.policies if p.admission == "kvgate" and p.autoscale == "none")
    trace = [replace(r, stream=True, max_tokens=None) for r in sc.trace(seconds / sc.duration_s)]
    config = parse_config(sc.config)
    profile = get_profile(sc.profile)
    sim_args = ["--profile", profile.name]
    if config.queue.inject_priority:
        sim_args += ["--scheduling-policy", "priority"]
    shutil.rmtree(workdir, ignore_errors=True)
    outcomes = [Outcome(r, next((t.tier for t in config.tenants if t.name == r.tenant), config.lowest_tier))
                for r in trace]
    with Stack(workdir, live_config(sc), upstreams=policy.nodes, sim_args=sim_args, nodes=True) as st:
        took = asyncio.run(_replay(st.url + "/v1/completions", profile.model_name, outcomes))
        opens = _breaker_opens(st.metrics_url)
    live_policy = replace(policy, name="live")
    lost = sum(1 for o in outcomes if o.status == 0)
    live = RunResult(live_policy, outcomes, took, took * policy.nodes, 1, [(0.0, policy.nodes)], opens, lost)
    virtual = simulate(config, replace(policy, name="virtual"), profile, trace, sc.seed)
    return report.summarize(live, config), report.summarize(virtual, config)


def gap(live: report.Summary, virtual: report.Summary) -> str:
    """How far apart the two runs are, figure by figure (live / virtual)."""
    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"

    rows = [["TTFT p50", report.fmt_s(live.all.ttft[0]), report.fmt_s(virtual.all.ttft[0]),
             ratio(live.all.ttft[0], virtual.all.ttft[0])],
            ["TTFT p99", report.fmt_s(live.all.ttft[2]), report.fmt_s(virtual.all.ttft[2]),
             ratio(live.all.ttft[2], virtual.all.ttft[2])],
            ["e2e p50", report.fmt_s(live.all.e2e[0]), report.fmt_s(virtual.all.e2e[0]),
             ratio(live.all.e2e[0], virtual.all.e2e[0])],
            ["e2e p99", report.fmt_s(live.all.e2e[2]), report.fmt_s(virtual.all.e2e[2]),
             ratio(live.all.e2e[2], virtual.all.e2e[2])],
            ["admitted", str(live.all.admitted), str(virtual.all.admitted), ratio(live.all.admitted,
                                                                                  virtual.all.admitted)],
            ["429", str(live.all.rejected_policy), str(virtual.all.rejected_policy), ""],
            ["503", str(live.all.rejected_capacity), str(virtual.all.rejected_capacity), ""]]
    return report.table(["figure", "live", "virtual", "live / virtual"], rows)


def live(a: argparse.Namespace) -> int:
    sc = get_scenario(a.scenario)
    lv, vt = run_live(sc, a.seconds, a.workdir)
    if a.json:
        print(json.dumps({"scenario": sc.name, "seconds": a.seconds, "requests": lv.all.offered,
                          "live": lv.to_json(), "virtual": vt.to_json()}, indent=2))
    else:
        print(f"## {sc.title}: the first {a.seconds:g} s, live and in virtual time\n")
        print(report.overview([lv, vt]) + "\n")
        print(report.by_tier([lv, vt]) + "\n")
        print(gap(lv, vt))
    return 1 if lv.result.lost else 0

