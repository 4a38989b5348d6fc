"""``kvgate bench overhead``: what kvgate costs on the request path, measured side by side.

One run starts a stand-in upstream (no token delay), then measures the same load twice:
plain Envoy proxying, and Envoy + kvgate on the full path (ext_proc decision on the buffered body,
Lua usage extraction, completion accounting over the gRPC access log). It reports req/s,
p50/p99 latency, the ratio, and kvgate's CPU time per request (user + system of its process,
from /proc, divided by the requests it decided).

With ``--replicas N`` (N > 1) it also runs the kvgate path twice with the Redis store (``store.redis``,
a local ``redis-server``): one replica — kvgate's CPU per request against the in-process store's, and
redis-server's own CPU per request beside it — and N replicas behind the same Envoy (CPU summed over the
replicas), for req/s with one replica against N.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ext_proc.cpuparts import ENV, PARTS
from ext_proc.identity import hash_key

from ..dev.stack import Stack, http_get
from ..envoy_config import EnvoyParams

KEY = "sk-bench"
BODY = '{"model":"standin-8b","messages":[{"role":"user","content":"Say hello in five words."}],"max_tokens":8%s}'


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wrk(url: str, seconds: float, connections: int, body: str, workdir: Path,
         rate: float | None = None) -> dict[str, Any]:
    """wrk at its most, or (``rate``) paced: each connection waits between its requests so that all of
    them together offer about ``rate`` req/s (wrk's ``delay()``; a connection's latency adds to its wait,
    so the offered rate is a little under ``rate``: the achieved one is reported)."""
    script = workdir / "post.lua"
    pace = ""
    if rate is not None and rate > 0:
        pace = f"function delay()\n  return {max(0.0, connections / rate * 1000.0):.3f}\nend\n"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{body}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {KEY}"\n' + pace
    )
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script),
         url + "/v1/chat/completions"],
        capture_output=True, text=True, check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert m, out
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    return {"rps": rps, "requests": total, "p50_ms": pct("50"), "p99_ms": pct("99"),
            "errors": int(non2xx.group(1)) if non2xx else 0}


def _builtin(url: str, seconds: float, connections: int, body: str, rate: float | None = None) -> dict[str, Any]:
    """Fallback load generator when wrk is not installed (it shares the CPU, so figures are lower)."""
    import asyncio

    import aiohttp

    lat: list[float] = []
    errors = 0

    async def worker(session: aiohttp.ClientSession, until: float) -> None:
        nonlocal errors
        while time.perf_counter() < until:
            t = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers={"authorization": f"Bearer {KEY}",
                                             "content-type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            lat.append(time.perf_counter() - t)
            if rate:
                await asyncio.sleep(connections / rate)

    async def main() -> float:
        async with aiohttp.ClientSession() as s:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(s, t0 + seconds) for _ in range(connections)))
            return time.perf_counter() - t0

    elapsed = asyncio.run(main())
    lat.sort()
    return {"rps": len(lat) / elapsed, "requests": len(lat), "p50_ms": lat[len(lat) // 2] * 1e3,
            "p99_ms": lat[int(len(lat) * 0.99)] * 1e3, "errors": errors}


def _cpu_of(st: Stack) -> tuple[float, float]:
    """CPU seconds so far of the stack's kvgate replicas (summed) and of its redis-server (0 without)."""
    kv = sum(_cpu_seconds(st.procs[name].pid) for name in st.replica_names if name in st.procs)
    redis = _cpu_seconds(st.procs["redis"].pid) if "redis" in st.procs else 0.0
    return kv, redis


def _parts(st: Stack) -> dict[str, float]:
    """kvgate's ``kvgate_cpu_part_seconds_total`` (``KVGATE_CPU_PARTS=1``), by part, summed over replicas."""
    out: dict[str, float] = {}
    for url in st.metrics_urls:
        _, text = http_get(url, timeout=5)
        for fam in text_string_to_metric_families(text.decode()):
            for smp in fam.samples:
                if smp.name == "kvgate_cpu_part_seconds_total":
                    part = smp.labels.get("part", "?")
                    out[part] = out.get(part, 0.0) + smp.value
    return out


def overhead(seconds: float = 10.0, connections: int = 16, stream: bool = False, quiet: bool = False,
             replicas: int = 1, breakdown: bool = True, access_log_batch: int = 0) -> dict[str, Any]:
    """Plain Envoy against Envoy + kvgate on the full request path (decision on the body, usage
    extraction, completion accounting), at the most each can do; with ``breakdown`` also, side by side
    in the same run: the transport floor (``kvgate.bench.bare``, a server that decides nothing), where
    kvgate's CPU goes (``KVGATE_CPU_PARTS``: core, metrics, logging, protobuf, shell; the transport is
    the rest), and the latency kvgate adds at half its maximum rate."""
    body = BODY % (',"stream":true' if stream else "")
    tool = "wrk" if shutil.which("wrk") else "builtin"
    cfg = {"tenants": [{"name": "bench", "api_key_sha256": [hash_key(KEY)], "max_concurrent": 10_000}]}
    results: dict[str, Any] = {"load_generator": tool, "connections": connections, "seconds": seconds,
                               "stream": stream, "envoy_workers": 1, "access_log_batch_bytes": access_log_batch}
    envoy = EnvoyParams(access_log_buffer_bytes=access_log_batch)
    Run = tuple[str, bool, int, bool, dict[str, Any]]
    runs: list[Run] = [("plain_envoy", False, 1, False, {}), ("envoy_kvgate", True, 1, False, {})]
    if breakdown:
        runs += [("transport_floor", True, 1, False, {"bare": True}),
                 ("breakdown", True, 1, False, {"extproc_env": {ENV: "1"}})]
    if replicas > 1:
        runs += [("redis_1", True, 1, True, {}), (f"redis_{replicas}", True, replicas, True, {})]
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        work = Path(tmp)

        def load(url: str, secs: float, rate: float | None = None) -> dict[str, Any]:
            if tool == "wrk":
                return _wrk(url, secs, connections, body, work, rate)
            return _builtin(url, secs, connections, body, rate)

        for name, with_kvgate, n, redis, extra in runs:
            st = Stack(work / name, cfg, upstreams=1, token_ms=0.0, envoy=envoy, with_kvgate=with_kvgate,
                       replicas=n, redis=redis, **extra)
            with st:
                load(st.url, 1.0)  # warm up connections, JIT of the Lua, Python caches
                kv0, redis0 = _cpu_of(st)
                parts0 = _parts(st) if name == "breakdown" else {}
                r = load(st.url, seconds)
                time.sleep(0.3)  # let the last access-log entries land before reading CPU
                kv1, redis1 = _cpu_of(st)
                if with_kvgate:
                    r["kvgate_cpu_us_per_request"] = (kv1 - kv0) / max(1, r["requests"]) * 1e6
                if redis:
                    r["replicas"] = n
                    r["redis_cpu_us_per_request"] = (redis1 - redis0) / max(1, r["requests"]) * 1e6
                if name == "breakdown":
                    parts1 = _parts(st)
                    per = {p: (parts1.get(p, 0.0) - parts0.get(p, 0.0)) / max(1, r["requests"]) * 1e6 for p in PARTS}
                    per["transport"] = max(0.0, r["kvgate_cpu_us_per_request"] - sum(per.values()))
                    per["total"] = r["kvgate_cpu_us_per_request"]
                    r["cpu_us_per_request"] = per
                if breakdown and name == "envoy_kvgate":
                    # half kvgate's maximum, the same offered rate for both paths: what kvgate adds
                    results["half_rate"] = {"rate": r["rps"] / 2}
                    results["half_rate"]["envoy_kvgate"] = load(st.url, seconds, r["rps"] / 2)
            results[name] = r
    results["ratio_rps"] = results["envoy_kvgate"]["rps"] / results["plain_envoy"]["rps"]
    if breakdown:
        with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
            st = Stack(Path(tmp) / "plain_half", cfg, upstreams=1, token_ms=0.0, envoy=EnvoyParams(),
                       with_kvgate=False)
            with st:
                work = Path(tmp)
                rate = results["half_rate"]["rate"]
                if tool == "wrk":
                    _wrk(st.url, 1.0, connections, body, work)
                    results["half_rate"]["plain_envoy"] = _wrk(st.url, seconds, connections, body, work, rate)
                else:
                    results["half_rate"]["plain_envoy"] = _builtin(st.url, seconds, connections, body, rate)
        h = results["half_rate"]
        h["added_p50_ms"] = h["envoy_kvgate"]["p50_ms"] - h["plain_envoy"]["p50_ms"]
        floor = results["transport_floor"]
        floor["ratio_rps"] = floor["rps"] / results["plain_envoy"]["rps"]
        # (the headline run's figures stay as they are: the breakdown ran apart, instrumented)
        results["cpu_breakdown_us_per_request"] = results.pop("breakdown")["cpu_us_per_request"]
        results["cpu_breakdown_us_per_request"]["transport_floor"] = floor["kvgate_cpu_us_per_request"]
    if replicas > 1:
        mem, one, many = results["envoy_kvgate"], results.pop("redis_1"), results.pop(f"redis_{replicas}")
        results["store"] = {
            "memory": {k: mem[k] for k in ("rps", "p50_ms", "p99_ms", "errors", "kvgate_cpu_us_per_request")},
            "redis": one,
            "kvgate_cpu_ratio": (one["kvgate_cpu_us_per_request"] / mem["kvgate_cpu_us_per_request"]
                                 if mem["kvgate_cpu_us_per_request"] > 0 else None),
        }
        results["replicas"] = {"n": replicas, "store": "redis", "one": one, "many": many,
                               "ratio_rps": many["rps"] / one["rps"] if one["rps"] > 0 else None}
    if not quiet:
        _print_overhead(results, tool, connections, seconds, stream, replicas)
    return results


def _print_overhead(results: dict[str, Any], tool: str, connections: int, seconds: float, stream: bool,
                    replicas: int) -> None:
    p, k = results["plain_envoy"], results["envoy_kvgate"]
    print(f"kvgate bench overhead  ({tool}, {connections} connections, {seconds:g}s each, 1 Envoy worker, "
          f"{'SSE' if stream else 'JSON'} responses)")
    print(f"{'path':<22}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'CPU us/req':>12}")
    rows = [("plain envoy", p), ("envoy + kvgate", k)]
    if "transport_floor" in results:
        rows.append(("envoy + bare ext_proc", results["transport_floor"]))
    for name, r in rows:
        cpu = f"{r['kvgate_cpu_us_per_request']:.0f}" if "kvgate_cpu_us_per_request" in r else "-"
        print(f"{name:<22}{r['rps']:>10.0f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['errors']:>8}{cpu:>12}")
    print(f"ratio (kvgate / plain): {results['ratio_rps']:.2f}   "
          f"kvgate CPU per request: {k['kvgate_cpu_us_per_request']:.0f} us")
    if "transport_floor" in results:
        f = results["transport_floor"]
        print(f"transport floor (a server that decides nothing): {f['kvgate_cpu_us_per_request']:.0f} us/request, "
              f"{f['ratio_rps']:.2f}x plain")
        b = results["cpu_breakdown_us_per_request"]
        print("where kvgate's CPU goes (us/request, an instrumented run of its own): " + ", ".join(
            f"{part} {b[part]:.0f}" for part in (*PARTS, "transport")) + f"; total {b['total']:.0f}")
        h = results["half_rate"]
        print(f"at half kvgate's maximum ({h['rate']:.0f} req/s offered): p50 plain "
              f"{h['plain_envoy']['p50_ms']:.2f} ms, with kvgate {h['envoy_kvgate']['p50_ms']:.2f} ms "
              f"(+{h['added_p50_ms']:.2f} ms)")
    if replicas > 1:
        one, many = results["replicas"]["one"], results["replicas"]["many"]
        print(f"\nstore: in-process vs Redis (1 replica), and 1 vs {replicas} replicas sharing Redis "
              f"(kvgate CPU summed over the replicas)")
        print(f"{'path':<22}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'kvgate us/req':>15}"
              f"{'redis us/req':>14}")
        for name, r in (("memory, 1 replica", k), ("redis, 1 replica", one),
                        (f"redis, {replicas} replicas", many)):
            rcpu = f"{r['redis_cpu_us_per_request']:.0f}" if "redis_cpu_us_per_request" in r else "-"
            print(f"{name:<22}{r['rps']:>10.0f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['errors']:>8}"
                  f"{r['kvgate_cpu_us_per_request']:>15.0f}{rcpu:>14}")
        cpu_ratio, rps_ratio = results["store"]["kvgate_cpu_ratio"], results["replicas"]["ratio_rps"]
        print(f"kvgate CPU per request, Redis / in-process: {'-' if cpu_ratio is None else f'{cpu_ratio:.2f}'}"
              f"   req/s, {replicas} replicas / 1: {'-' if rps_ratio is None else f'{rps_ratio:.2f}'}")
    sys.stdout.flush()


def sim_speed(seconds: float = 600.0, nodes: int = 8, rate: float = 200.0, profile: str = "8b-h100",
              seed: int = 1, quiet: bool = False) -> dict[str, Any]:
    """Virtual-time speed of the simulated fleet: how much faster than real time it runs.

    The mix is the field guide's: 60% short requests (100-400 prompt tokens, 50-150 output), 40%
    long ones (2000-4000 prompt, 200-500 output), Poisson arrivals, least-outstanding routing.
    """
    import random

    from ext_proc.profiles import get_profile
    from sim.engine import Engine
    from sim.fleet import simulate_fleet
    from sim.scheduler import Request

    rng = random.Random(seed)
    t = 0.0
    reqs: list[Request] = []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        if rng.random() < 0.6:
            reqs.append(Request(str(len(reqs)), rng.randint(100, 400), rng.randint(50, 150), t))
        else:
            reqs.append(Request(str(len(reqs)), rng.randint(2000, 4000), rng.randint(200, 500), t))
    engines = [Engine(get_profile(profile)) for _ in range(nodes)]
    c0, t0 = time.process_time(), time.perf_counter()
    simulate_fleet(engines, reqs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    done = sorted(r.first_token - r.arrival for r in reqs if r.first_token is not None)
    tokens = sum(r.output_tokens for r in reqs)
    out = {"virtual_seconds": seconds, "nodes": nodes, "rate": rate, "profile": profile, "requests": len(reqs),
           "finished": sum(r.finished_at is not None for r in reqs), "steps": sum(e.steps for e in engines),
           "tokens": tokens, "wall_seconds": wall, "cpu_seconds": cpu, "speedup": seconds / wall,
           "ttft_p50_s": done[len(done) // 2] if done else None,
           "ttft_p99_s": done[int(len(done) * 0.99)] if done else None}
    if not quiet:
        print(f"kvgate bench sim: {seconds:g} s of {nodes} x {profile} at {rate:g} req/s in virtual time")
        print(f"  {out['requests']} requests ({out['finished']} finished), {out['steps']} engine steps, "
              f"{tokens} output tokens")
        print(f"  ran in {wall:.1f} s wall / {cpu:.1f} s CPU on one core: {out['speedup']:.0f}x real time")
        print(f"  TTFT p50 {out['ttft_p50_s']:.2f} s, p99 {out['ttft_p99_s']:.2f} s (no admission control)")
    return out


def queue_scaling(sizes: tuple[int, ...] = (0, 1_000, 10_000), ops: int = 3000, quiet: bool = False
                  ) -> list[dict[str, float]]:
    """``kvgate bench queue``: the decision core's cost per operation with 0, 1k and 10k requests queued.

    The real ``Admission`` (tiers, VTC counters, deadlines) with 60 tenants over three tiers and the
    fleet full, so every arrival queues. Per size: an arrival that is queued (then cancelled, to keep
    the size), a pump that finds no room (what every tick and completion costs), and a release
    (one slot frees: pump releases the next request, which then completes; a new arrival refills).
    """
    import random

    from ext_proc.admission import Admission, Usage
    from ext_proc.config import parse_config
    from ext_proc.estimate import Estimate

    tiers = ("interactive", "standard", "batch")
    cfg = parse_config({
        "fleet": {"max_inflight": 1},
        "queue": {"max_size": max(sizes) + 10},
        "tiers": {t: {"priority": i, "max_queue_wait_ms": 55_000} for i, t in enumerate(tiers)},
        "tenants": [{"name": f"t{i}", "tier": tiers[i % 3], "weight": 1 + i % 4} for i in range(60)],
    })
    rows = []
    for n in sizes:
        t = [0.0]

        def clock(t: list[float] = t) -> float:
            t[0] += 1e-6  # creeps forward: nothing expires, ordering by arrival still holds
            return t[0]

        a = Admission(cfg, clock, random.Random(0))
        rng = random.Random(n)
        tenants = [cfg.tenant(f"t{i}") for i in range(60)]

        def arrive(i: int, a: Admission = a, rng: random.Random = rng, tenants: list[Any] = tenants) -> str:
            est = Estimate(rng.randint(20, 4000), rng.randint(8, 512), parsed=True)
            d = a.decide(tenants[rng.randrange(60)], f"r{i}", est, 100)
            assert d.lease is not None
            return d.lease.ticket

        hog = arrive(-1)  # holds the only slot
        for i in range(n):
            arrive(i)
        assert a.queued == n

        t0 = time.perf_counter()
        for i in range(ops):
            a.cancel(arrive(n + i))
        enqueue_us = (time.perf_counter() - t0) / ops * 1e6

        t0 = time.perf_counter()
        for _ in range(ops):
            a.pump()
        pump_us = (time.perf_counter() - t0) / ops * 1e6

        if n:
            t0 = time.perf_counter()
            running = hog
            for i in range(ops):
                a.complete(running, Usage(100, 50), responded=True)  # a slot frees ...
                out = a.pump()  # ... the next request goes
                assert len(out) == 1 and out[0].decision.lease is not None
                running = out[0].decision.lease.ticket
                arrive(2 * n + ops + i)  # and a new one arrives
            release_us = (time.perf_counter() - t0) / ops * 1e6
        else:
            release_us = float("nan")
        rows.append({"queued": n, "enqueue_us": enqueue_us, "pump_us": pump_us, "release_us": release_us})
    if not quiet:
        print(f"kvgate bench queue: decision core, 60 tenants in 3 tiers, {ops} ops per figure (µs per op)")
        print(f"{'queued':>8} {'arrival->queued':>16} {'pump, no room':>14} {'release+complete+arrival':>25}")
        for r in rows:
            print(f"{int(r['queued']):>8} {r['enqueue_us']:>16.1f} {r['pump_us']:>14.2f} {r['release_us']:>25.1f}")
        ref = next((r for r in rows if r["queued"]), None)
        last = rows[-1]
        if ref is not None and ref is not last:
            print(f"{int(last['queued'])} queued vs {int(ref['queued'])}: "
                  + ", ".join(f"{k.removesuffix('_us')} x{last[k] / ref[k]:.2f}"
                              for k in ("enqueue_us", "pump_us", "release_us"))
                  + f" (log2 ratio {math.log2(last['queued']) / math.log2(ref['queued']):.2f})")
    return rows


def node_choice(sizes: tuple[int, ...] = (8, 64, 1_000), ops: int = 5000, quiet: bool = False
                ) -> list[dict[str, float]]:
    """``kvgate bench nodes``: what one node choice costs as the fleet grows — the whole ``Fleet.place``
    (filters, predictions, pick, booking) and the predictions' share of it (``Fleet.predict`` over the
    candidates a decision looks at), with every node read by a probe and carrying work."""
    from ext_proc.config import Nodes
    from ext_proc.nodes import MAX_CANDIDATES, Fleet, Level
    from gpu_probe.snapshot import Snapshot

    rows = []
    for n in sizes:
        cfg = Nodes.model_validate({"static": [{"address": f"10.0.{i // 250}.{i % 250}:8000",
                                                "probe": f"http://10.0.{i // 250}.{i % 250}:9102"}
                                               for i in range(n)]})
        fleet = Fleet(cfg, rng=random.Random(1))
        fleet.set_levels([Level(0, 0.2), Level(1, 1.0), Level(2, 5.0)])
        rng = random.Random(2)
        now = 100.0
        for node in fleet.nodes.values():
            snap = Snapshot(node.address, now, True, kv_usage=rng.uniform(0.2, 0.7), blocks_total=27_306,
                            block_size=16, running=float(rng.randint(5, 60)), waiting=float(rng.randint(0, 3)),
                            itl_s=0.02, step_fresh=True, step_tokens=400.0, step_decode=30.0)
            fleet.on_snapshot(node.address, snap, now)
        prompts = [rng.choice((200, 300, 3000)) for _ in range(ops)]
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            c = fleet.place(p + 200, p, f"t{i}", now, priority=i % 3, target=0.2 * (1 + 4 * (i % 3)), limit=5.0)
            if c.node is not None:
                fleet.completed(c.node.address, f"t{i}", p + 200, True, now)
        place_us = (time.perf_counter() - t0) / ops * 1e6
        sample = list(fleet.nodes.values())[:MAX_CANDIDATES]
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            for node in sample:
                fleet.predict(node, p, i % 3, now)
        predict_us = (time.perf_counter() - t0) / ops * 1e6
        rows.append({"nodes": n, "place_us": place_us, "predict_us": predict_us})
    if not quiet:
        print(f"kvgate bench nodes: one node choice, {ops} decisions per figure (µs per decision)")
        print(f"{'nodes':>6} {'place (all of it)':>18} {'of which predictions':>21}")
        for r in rows:
            print(f"{int(r['nodes']):>6} {r['place_us']:>18.1f} {r['predict_us']:>21.1f}")
    return rows


def prefix_index(entries: int = 100_000, nodes: int = 8, ops: int = 2000, quiet: bool = False) -> dict[str, float]:
    """``kvgate bench prefix``: what prefix affinity costs — memory of an index holding ``entries``
    distinct prompt blocks spread over ``nodes`` nodes, and per decision: hashing a 16,000-character
    prompt (4,000 tokens, 31 blocks of 512 characters) and matching it against that index, then one
    whole node choice with and without the prefix."""
    import tracemalloc

    from ext_proc.config import Nodes
    from ext_proc.nodes import Fleet, Level
    from ext_proc.prefix import PrefixIndex, text_chain
    from gpu_probe.snapshot import Snapshot

    rng = random.Random(4)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(max_blocks_per_node=entries // nodes + 1, ttl_s=600.0)
    per_chain = 50
    for k in range(entries // per_chain):
        idx.record(f"n{k % nodes}", tuple(rng.getrandbits(63) for _ in range(per_chain)), now=0.0)
    mem_mb = (tracemalloc.get_traced_memory()[0] - before) / 2**20
    tracemalloc.stop()
    prompts = ["".join(rng.choice("abcdefgh ") for _ in range(400)) * 40 for _ in range(20)]
    t0 = time.perf_counter()
    chains = [text_chain(prompts[i % 20], 512, 128) for i in range(ops)]
    hash_us = (time.perf_counter() - t0) / ops * 1e6
    for i, c in enumerate(chains[:20]):
        idx.record(f"n{i % nodes}", c, now=1.0)
    t0 = time.perf_counter()
    for i, c in enumerate(chains):
        idx.match(c, now=2.0)
        idx.record(f"n{i % nodes}", c, 2.0)
    match_us = (time.perf_counter() - t0) / ops * 1e6
    cfg = Nodes.model_validate({"static": [{"address": f"10.0.0.{i}:8000", "probe": f"http://10.0.0.{i}:9102"}
                                           for i in range(nodes)]})
    place_us: dict[str, float] = {}
    for with_prefix in (False, True):
        fleet = Fleet(cfg, rng=random.Random(1))
        fleet.set_levels([Level(0, 0.2), Level(1, 1.0)])
        for node in fleet.nodes.values():
            fleet.on_snapshot(node.address, Snapshot(node.address, 0.0, True, kv_usage=0.3, blocks_total=27_306,
                                                     block_size=16, running=20.0, waiting=0.0, itl_s=0.02,
                                                     step_fresh=True, step_tokens=400.0, step_decode=30.0), 0.0)
        spent = 0.0
        for i, c in enumerate(chains):
            now = 3.0 + i * 0.01
            if i % 25 == 0:  # a probe reading now and then, as in production (it settles what was sent)
                for node in fleet.nodes.values():
                    fleet.on_snapshot(node.address, Snapshot(node.address, now, True, kv_usage=0.3,
                                                             blocks_total=27_306, block_size=16, running=20.0,
                                                             waiting=0.0), now)
            t0 = time.perf_counter()
            ch = fleet.place(4200, 4000, f"t{i}", now, priority=i % 2, target=0.2 if i % 2 == 0 else 1.0,
                             limit=5.0, prefix=c if with_prefix else ())
            spent += time.perf_counter() - t0
            if ch.node is not None:
                fleet.completed(ch.node.address, f"t{i}", 4200, True, now)
        place_us["with" if with_prefix else "without"] = spent / ops * 1e6
    out = {"entries": float(len(idx)), "memory_mb": mem_mb, "hash_us": hash_us, "match_record_us": match_us,
           "place_us_without_prefix": place_us["without"], "place_us_with_prefix": place_us["with"]}
    if not quiet:
        print(f"kvgate bench prefix: an index of {len(idx):,} prompt blocks over {nodes} nodes: {mem_mb:.1f} MB")
        print(f"per decision (4,000-token prompt, {ops} decisions): hash {hash_us:.1f} µs + match and record "
              f"{match_us:.1f} µs;"
              f" a whole node choice {place_us['without']:.1f} µs without the prefix, {place_us['with']:.1f} µs"
              " with it")
    return out
