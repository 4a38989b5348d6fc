"""``kvgate bench scale``: what kvgate costs as the fleet grows — per decision, and to follow the probes.

Two figures, each against the fleet's size:

* **decision time** — p50/p99 of ``Core.decide`` on realistic JSON chat bodies through the real core
  (identity, estimate, prefix chain, admission, node choice, body rewrite), against 10, 100 and 1,000
  nodes whose probes were all read within the last period, and 10 or 10,000 tenants. Virtual time
  (1,000 requests a second), so a busy machine slows the figures but cannot reorder them; every
  request ends a little later (``Core.ended``), so nodes carry work.
* **following the probes** — the CPU kvgate spends following N probes at a 250 ms period, as a share
  of one core: process CPU time (user + system, every thread) over the wall time of the window, of the
  kvgate side only. The probes are the real probe server (``gpu_probe.server.Probe``: its
  ``GET /snapshot`` and its stream) with a random walk for vLLM, N of them on N ports in a separate
  process, every reading different from the last (a busy fleet: the worst case for deltas). kvgate
  runs ``ext_proc.server.poll_nodes`` as production does (uvloop when installed). Measured twice:
  probes that stream (``GET /snapshot/stream``) and probes that do not (an older probe: kvgate polls
  ``GET /snapshot`` of each, one GET per node per period — how every probe was followed before).
  CPU time is what is measured, not wall time: another busy process on the machine cannot inflate it,
  though it can starve the simulated probes — hence readings/s beside each figure and the CPU per
  reading, from which the share at the full rate follows.

* **with requests waiting** (:func:`waiting_queue`) — a full 1,000-node fleet and the gateway queue full
  (15): what a probe reading and a decision cost when each event asks the queue whether anything can go.

Targets (issue 17): decision p99 <= 200 µs at 1,000 nodes and 10,000 tenants; following 1,000 nodes at
250 ms with <= 25% of one core. Issue 28: with the queue full, a probe reading <= 50 µs (the mean: what
4,000 readings a second cost) and a decision <= 200 µs p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from ext_proc.follow import raise_file_limit
from gpu_probe.server import Probe
from gpu_probe.snapshot import Snapshot

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DECISION_TARGET_US = 200.0
WAITING_READING_TARGET_US = 50.0
FOLLOW_TARGET_SHARE = 0.25
TIERS = ("interactive", "standard", "batch")


# -- decision time ---------------------------------------------------------------------------------


def _bodies(rng: random.Random, count: int = 256) -> list[bytes]:
    """Chat bodies as clients send them: one of a few system prompts (shared prefixes), a conversation
    of one to six turns, sometimes streaming (kvgate then rewrites the body for the usage chunk)."""
    words = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by",
             "this", "are", "or", "at", "from", "have", "not", "an", "they", "which", "one", "you", "had", "word",
             "but", "what", "all", "were", "when", "we", "there", "can", "your", "use", "each", "how", "their",
             "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "would",
             "make", "like", "into", "time", "kv", "cache", "token", "prompt", "model", "node", "request"]

    def text(n_words: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n_words))

    systems = [text(rng.randint(60, 400)) for _ in range(6)]
    out = []
    for _ in range(count):
        msgs: list[dict[str, str]] = [{"role": "system", "content": rng.choice(systems)}]
        for turn in range(rng.randint(1, 6)):
            msgs.append({"role": "user", "content": text(rng.randint(5, 120))})
            if turn:
                msgs.insert(-1, {"role": "assistant", "content": text(rng.randint(10, 150))})
        doc: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": rng.choice((64, 128, 256, 512)),
                               "temperature": 0.7}
        if rng.random() < 0.5:
            doc["stream"] = True
        out.append(json.dumps(doc).encode())
    return out


def _reading(rng: random.Random, address: str, at: float) -> Snapshot:
    return Snapshot(node=address, at=at, ok=True, kv_usage=rng.uniform(0.1, 0.7), kv_metric="vllm:kv_cache_usage_perc",
                    blocks_total=27_306, blocks_used=None, block_size=16, running=float(rng.randint(2, 60)),
                    waiting=float(rng.choice((0, 0, 0, 1, 2))), preemptions_per_s=0.0, itl_s=rng.uniform(0.015, 0.03),
                    step_fresh=True, step_tokens=rng.uniform(100, 600), step_decode=rng.uniform(10, 60),
                    prefill_s=rng.uniform(0.02, 0.2), latency_fresh=True, prefill_s_per_ktok=rng.uniform(0.02, 0.06))


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100.0 * len(s)))]


def decision_time(nodes: tuple[int, ...] = (10, 100, 1_000), tenants: tuple[int, ...] = (10, 10_000),
                  ops: int = 20_000, quiet: bool = False) -> list[dict[str, float]]:
    """p50/p99 µs of ``Core.decide`` per (nodes, tenants); see the module's docstring."""
    from ext_proc.admission import Usage
    from ext_proc.config import parse_config
    from ext_proc.core import Answer, Core, Ended, Request, null_logger
    from ext_proc.identity import hash_key

    rng = random.Random(7)
    bodies = _bodies(rng)
    rows = []
    for n_tenants in tenants:
        tenant_cfg = [{"name": f"t{i}", "tier": TIERS[i % 3], "api_key_sha256": [hash_key(f"sk-scale-{i}")],
                       "max_concurrent": 64, "requests_per_minute": 600_000, "tokens_per_minute": 1_000_000_000}
                      for i in range(n_tenants)]
        keys = [f"Bearer sk-scale-{i}" for i in range(n_tenants)]
        for n_nodes in nodes:
            addrs = [f"10.{i // 62_500}.{i // 250 % 250}.{i % 250 + 1}:8000" for i in range(n_nodes)]
            cfg = parse_config({
                "tenants": tenant_cfg,
                "fleet": {"max_inflight": 100_000},
                "nodes": {"static": [{"address": a, "probe": f"http://{a.split(':')[0]}:9102"} for a in addrs],
                          "kv_admit_threshold": 0.92},
            })
            t = [1000.0]
            core = Core(cfg, lambda t=t: t[0], rng=random.Random(1), log=null_logger())  # type: ignore[misc]
            feed = random.Random(3)

            def read_all(core: Core = core, feed: random.Random = feed, addrs: list[str] = addrs,
                         t: list[float] = t) -> None:
                for a in addrs:
                    core.snapshot(a, _reading(feed, a, t[0]), 0.0)

            read_all()
            open_: deque[tuple[str, str, int]] = deque()
            samples: list[float] = []
            ends: list[float] = []
            admitted = 0
            warm = min(2_000, ops // 5)
            next_read = t[0] + 0.25
            pick = random.Random(5)
            gc.collect()
            for i in range(warm + ops):
                t[0] += 0.001  # 1,000 requests a second
                if t[0] >= next_read:  # every node read by its probe each 250 ms, as the poller delivers them
                    read_all()
                    next_read += 0.25
                body = bodies[i % len(bodies)]
                req = Request(path="/v1/chat/completions", request_id=f"r{i}",
                              authorization=keys[pick.randrange(n_tenants)], body=body, envoy="envoy-1")
                t0 = time.perf_counter_ns()
                out = core.decide(req)
                dt = time.perf_counter_ns() - t0
                if i >= warm:
                    samples.append(dt / 1000.0)
                if isinstance(out, Answer) and out.ticket is not None:
                    admitted += i >= warm
                    open_.append((out.ticket, req.request_id, len(body) // 4))
                while len(open_) > 200:  # ~0.2 s in flight each
                    ticket, rid, prompt = open_.popleft()
                    t0 = time.perf_counter_ns()
                    core.ended(Ended(ticket, rid, 200, Usage(prompt, 100), upstream_answered=True))
                    ends.append((time.perf_counter_ns() - t0) / 1000.0)
            rows.append({"nodes": n_nodes, "tenants": n_tenants, "decide_p50_us": _pct(samples, 50),
                         "decide_p99_us": _pct(samples, 99), "ended_p50_us": _pct(ends, 50) if ends else 0.0,
                         "admitted": admitted / ops, "ops": ops})
    if not quiet:
        print(f"kvgate bench scale: Core.decide on chat bodies, {ops} decisions per figure, nodes read every 250 ms")
        print(f"{'nodes':>6} {'tenants':>8} {'p50 µs':>8} {'p99 µs':>8} {'ended p50':>10} {'admitted':>9}")
        for r in rows:
            print(f"{int(r['nodes']):>6} {int(r['tenants']):>8} {r['decide_p50_us']:>8.1f} {r['decide_p99_us']:>8.1f}"
                  f" {r['ended_p50_us']:>10.1f} {r['admitted']:>9.0%}")
    return rows


def waiting_queue(n_nodes: int = 1_000, waiting: int = 15, ops: int = 5_000, quiet: bool = False,
                  once_per_turn: bool = False) -> dict[str, Any]:
    """The costs when requests wait: ``n_nodes`` nodes whose KV is all above the admit threshold (a full
    fleet), the gateway queue holding ``waiting`` requests (its ``max_size``), and per millisecond of
    virtual time one new request and a probe reading from 4 nodes (every node read each 250 ms). Every
    event that may free room (a reading, a decision) asks the queue whether anything can go now — what
    it costs with the fleet full is the figure: µs per probe reading (``Core.snapshot``) and per decision
    (``Core.decide``, p50/p99). ``once_per_turn``: as the live shell runs the core
    (``Core.pump_once_per_turn``), each millisecond is one loop turn whose events ask for one pump at its
    end; ``turn_us`` (the CPU of a whole millisecond: its readings, its decision and that pump) compares
    the two."""
    from ext_proc.config import parse_config
    from ext_proc.core import Core, Request, null_logger
    from ext_proc.identity import hash_key

    rng = random.Random(11)
    bodies = _bodies(rng)
    n_tenants = 30
    addrs = [f"10.{i // 62_500}.{i // 250 % 250}.{i % 250 + 1}:8000" for i in range(n_nodes)]
    cfg = parse_config({
        "tenants": [{"name": f"t{i}", "tier": TIERS[i % 3], "api_key_sha256": [hash_key(f"sk-wait-{i}")],
                     "max_concurrent": 64, "requests_per_minute": 600_000, "tokens_per_minute": 1_000_000_000}
                    for i in range(n_tenants)],
        "fleet": {"max_inflight": 100_000},
        "queue": {"max_size": waiting},
        "nodes": {"static": [{"address": a, "probe": f"http://{a.split(':')[0]}:9102"} for a in addrs],
                  "kv_admit_threshold": 0.92},
    })
    t = [1000.0]
    core = Core(cfg, lambda t=t: t[0], rng=random.Random(1), log=null_logger())  # type: ignore[misc]
    feed = random.Random(3)
    turn: list[Callable[[], None]] = []
    if once_per_turn:
        core.pump_once_per_turn(turn.append)

    def full(address: str) -> Snapshot:
        # above the admit threshold (0.92), below the breaker's (0.95): the fleet is full, not sick
        return replace(_reading(feed, address, t[0]), kv_usage=feed.uniform(0.93, 0.945))

    for a in addrs:
        core.snapshot(a, full(a), 0.0)
    reads: list[float] = []
    decides: list[float] = []
    queued = 0
    warm = min(1_000, ops // 5)
    k = 0
    gc.collect()
    turns: list[float] = []
    for i in range(warm + ops):
        t[0] += 0.001
        start = time.perf_counter_ns()
        for _ in range(4):  # 4 readings a millisecond: 1,000 nodes each read every 250 ms
            a = addrs[k % n_nodes]
            k += 1
            snap = full(a)
            t0 = time.perf_counter_ns()
            core.snapshot(a, snap, 0.0)
            dt = time.perf_counter_ns() - t0
            if i >= warm:
                reads.append(dt / 1000.0)
        req = Request(path="/v1/chat/completions", request_id=f"w{i}", authorization=f"Bearer sk-wait-{i % n_tenants}",
                      body=bodies[i % len(bodies)], envoy="envoy-1")
        t0 = time.perf_counter_ns()
        core.decide(req)
        dt = time.perf_counter_ns() - t0
        while turn:  # the end of the loop turn: the one pump its events asked for
            turn.pop()()
        core.answers()
        end = time.perf_counter_ns()
        if i >= warm:
            decides.append(dt / 1000.0)
            turns.append((end - start) / 1000.0)
            queued += core.queued
    row = {"nodes": n_nodes, "waiting": waiting, "queued_mean": queued / ops, "reading_p50_us": _pct(reads, 50),
           "reading_mean_us": sum(reads) / len(reads), "reading_p99_us": _pct(reads, 99),
           "decide_p50_us": _pct(decides, 50), "decide_p99_us": _pct(decides, 99), "ops": ops,
           "once_per_turn": once_per_turn, "turn_mean_us": sum(turns) / len(turns)}
    if not quiet:
        how = "one pump per loop turn" if once_per_turn else "a pump per event"
        print(f"\nwith requests waiting ({how}): {n_nodes} nodes all full, the gateway queue holding up to "
              f"{waiting} (mean {row['queued_mean']:.1f}), {ops} decisions and {len(reads)} readings")
        print(f"{'reading p50 µs':>15} {'mean':>8} {'p99':>8} {'decide p50 µs':>14} {'p99':>8} {'per turn µs':>12}")
        print(f"{row['reading_p50_us']:>15.1f} {row['reading_mean_us']:>8.1f} {row['reading_p99_us']:>8.1f}"
              f" {row['decide_p50_us']:>14.1f} {row['decide_p99_us']:>8.1f} {row['turn_mean_us']:>12.1f}")
    return row


# -- the simulated probes --------------------------------------------------------------------------


class SimProbe(Probe):
    """The real probe server in front of a random walk instead of vLLM: every read changes the node's
    load figures (KV, running, waiting, step and prefill times, the engine row), as on a busy node."""

    def __init__(self, index: int, interval: float, seed: int) -> None:
        super().__init__(f"http://sim-node-{index}:8000", interval)
        self._rng = random.Random(seed)
        self._kv = self._rng.uniform(0.2, 0.6)

    async def poll_once(self, session: Any = None) -> Snapshot:
        r = self._rng
        self._kv = min(0.85, max(0.05, self._kv + r.uniform(-0.03, 0.03)))  # (below the breaker's 0.95)
        running, waiting = float(r.randint(5, 60)), float(r.choice((0, 0, 1, 2)))
        snap = Snapshot(
            node=self.url, at=time.time(), ok=True, kv_usage=round(self._kv, 4), kv_metric="vllm:kv_cache_usage_perc",
            blocks_total=27_306, blocks_used=round(27_306 * self._kv), block_size=16, running=running,
            waiting=waiting, preemptions_per_s=0.0, ttft_s=r.uniform(0.05, 0.3), itl_s=r.uniform(0.015, 0.03),
            prefill_s=r.uniform(0.02, 0.2), prefill_s_per_ktok=r.uniform(0.02, 0.06), latency_fresh=True,
            queue_s=r.uniform(0.0, 0.05), step_fresh=True, step_tokens=r.uniform(100, 600),
            step_decode=r.uniform(10, 60), prefix_hit_rate=r.uniform(0.0, 0.8),
            engines=[{"model": MODEL, "engine": "0", "kv_usage": round(self._kv, 4), "running": running,
                      "waiting": waiting}],
        )
        self.publish(snap)
        return snap

    def older_app(self) -> web.Application:
        """A probe from before the stream: ``GET /snapshot`` only (the stream's path answers 404)."""
        app = web.Application()
        app.router.add_get("/snapshot", self.snapshot)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _run(self) -> None:
        await asyncio.sleep(self._rng.uniform(0, self.interval))  # a fleet's probes read out of step
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)


async def _serve_probes(count: int, interval: float, stream: bool, seed: int) -> None:
    """``count`` simulated probes, each on a port of its own (kvgate keeps a connection per probe, as it
    would per node); prints the ports as one JSON line, then serves until SIGTERM or stdin closes."""
    runners = []
    ports = []
    for i in range(count):
        probe = SimProbe(i, interval, seed * 100_003 + i)
        app = probe.app() if stream else probe.older_app()
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock)
        await site.start()
        runners.append(runner)
        ports.append(sock.getsockname()[1])
    print(json.dumps(ports), flush=True)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    stdin = sys.stdin.fileno()  # the parent closes it (or dies): stop
    loop.add_reader(stdin, lambda: done.set() if not os.read(stdin, 1) else None)
    await done.wait()
    for r in runners:
        await r.cleanup()


# -- following the probes --------------------------------------------------------------------------


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loop_factory() -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    try:
        import uvloop

        return uvloop.new_event_loop, "uvloop"
    except ImportError:
        return asyncio.new_event_loop, "asyncio"


async def _follow(ports: list[int], period: float, warmup: float, seconds: float) -> dict[str, float]:
    from ext_proc.config import parse_config
    from ext_proc.server import Gateway, poll_nodes

    addrs = [f"10.{i // 62_500}.{i // 250 % 250}.{i % 250 + 1}:8000" for i in range(len(ports))]
    cfg = parse_config({"nodes": {"static": [{"address": a, "probe": f"http://127.0.0.1:{p}"}
                                             for a, p in zip(addrs, ports, strict=True)],
                                  "poll_interval_seconds": period}})
    gw = Gateway(cfg)
    core = gw.core
    readings = [0]
    apply = core.snapshot

    def counted(address: str, snap: Snapshot, age_s: float = 0.0) -> None:
        readings[0] += 1
        apply(address, snap, age_s)

    core.snapshot = counted  # type: ignore[method-assign]
    task = asyncio.create_task(poll_nodes(gw))
    try:
        await asyncio.sleep(warmup)
        r0, c0, th0, w0 = readings[0], _cpu(), time.thread_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        r1, c1, th1, w1 = readings[0], _cpu(), time.thread_time(), time.perf_counter()
    finally:
        task.cancel()
        # (asyncio.wait, not a timeout around the await: a follower that ignored its cancel would hold that
        # await too; one that does not stop within 30 s is an error, not a hang)
        done, _ = await asyncio.wait({task}, timeout=30)
        if not done:
            raise RuntimeError("the probe follower did not stop within 30 s of its cancel")
        with contextlib.suppress(asyncio.CancelledError):
            task.result()
    fleet = core.fleet
    assert fleet is not None
    now = time.monotonic()
    ages = sorted(now - n.fresh_at if n.fresh_at is not None else float("inf") for n in fleet.nodes.values())
    wall = w1 - w0
    got = r1 - r0
    cpu = c1 - c0
    return {"cpu_share": cpu / wall, "loop_thread_share": (th1 - th0) / wall, "readings_per_s": got / wall,
            "expected_per_s": len(ports) / period, "cpu_us_per_reading": cpu / got * 1e6 if got else float("nan"),
            "age_p50_s": ages[len(ages) // 2], "age_max_s": ages[-1]}


def follow_cpu(sizes: tuple[int, ...] = (10, 100, 1_000), period: float = 0.25, seconds: float = 10.0,
               warmup: float = 3.0, stream: bool = True) -> list[dict[str, Any]]:
    """kvgate's CPU following ``sizes`` simulated probes at ``period``; ``stream`` False: probes without
    the stream (kvgate polls them)."""
    raise_file_limit()
    factory, loop_name = _loop_factory()
    rows: list[dict[str, Any]] = []
    for n in sizes:
        sim = subprocess.Popen(
            [sys.executable, "-m", "kvgate.bench.scale", "--serve-probes", str(n), "--interval", str(period),
             *([] if stream else ["--no-stream"])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert sim.stdout is not None
            ready, _, _ = select.select([sim.stdout], [], [], 120)
            line = sim.stdout.readline() if ready else b""
            if not line:
                raise RuntimeError("the simulated probes did not start" if sim.poll() is None else
                                   f"the simulated probes exited with {sim.returncode}")
            ports = json.loads(line)
            s0 = _proc_cpu(sim.pid)
            with asyncio.Runner(loop_factory=factory) as runner:
                row = runner.run(_follow(ports, period, warmup, seconds))
            row["probes_cpu_share"] = (_proc_cpu(sim.pid) - s0) / (warmup + seconds)
        finally:
            if sim.stdin is not None:
                sim.stdin.close()
            try:
                sim.wait(10)
            except subprocess.TimeoutExpired:
                sim.kill()
                sim.wait()
        rows.append({"nodes": n, "period_s": period, "mode": "stream" if stream else "poll", "loop": loop_name,
                     **row, "projected_share": row["cpu_us_per_reading"] * n / period / 1e6})
    return rows


def scale(nodes: tuple[int, ...] = (10, 100, 1_000), tenants: tuple[int, ...] = (10, 10_000), ops: int = 20_000,
          follow_nodes: tuple[int, ...] = (10, 100, 1_000), period: float = 0.25, seconds: float = 10.0,
          modes: tuple[str, ...] = ("poll", "stream"), quiet: bool = False, waiting_nodes: int = 1_000,
          waiting: int = 15) -> dict[str, Any]:
    """``kvgate bench scale``: the figures, and whether they meet issue 17's and issue 28's targets."""
    from ext_proc import logs

    logs.setup("warning")
    decisions = decision_time(nodes, tenants, ops, quiet=quiet) if ops else []
    queue = waiting_queue(waiting_nodes, waiting, max(1_000, ops // 4), quiet=quiet) if ops and waiting_nodes else None
    per_turn = waiting_queue(waiting_nodes, waiting, max(1_000, ops // 4), quiet=quiet, once_per_turn=True) \
        if ops and waiting_nodes else None
    follow: list[dict[str, Any]] = []
    for mode in modes:
        follow += follow_cpu(follow_nodes, period, seconds, stream=mode == "stream")
    if not quiet and follow:
        print(f"\nfollowing the probes at a {period * 1000:.0f} ms period: kvgate's CPU (process, all threads) "
              f"as a share of one core, {seconds:.0f} s per figure ({follow[0]['loop']})")
        print(f"{'mode':>7} {'nodes':>6} {'CPU share':>10} {'readings/s':>11} {'of':>7} {'µs/reading':>11}"
              f" {'at full rate':>13} {'age max s':>10} {'probes CPU':>11}")
        for r in follow:
            print(f"{r['mode']:>7} {r['nodes']:>6} {r['cpu_share']:>10.1%} {r['readings_per_s']:>11.0f}"
                  f" {r['expected_per_s']:>7.0f} {r['cpu_us_per_reading']:>11.1f} {r['projected_share']:>13.1%}"
                  f" {r['age_max_s']:>10.2f} {r['probes_cpu_share']:>11.1%}")
    big_d = [r for r in decisions if r["nodes"] == max(nodes) and r["tenants"] == max(tenants)]
    big_f = [r for r in follow if r["nodes"] == max(follow_nodes) and r["mode"] == modes[-1]]
    targets: dict[str, dict[str, Any]] = {
        "decision_p99_us": {"target": DECISION_TARGET_US, "nodes": max(nodes), "tenants": max(tenants),
                            "measured": big_d[0]["decide_p99_us"] if big_d else None},
        "follow_share": {"target": FOLLOW_TARGET_SHARE, "nodes": max(follow_nodes), "period_s": period,
                         "mode": modes[-1] if modes else None,
                         "measured": big_f[0]["cpu_share"] if big_f else None},
    }
    targets["waiting_reading_us"] = {"target": WAITING_READING_TARGET_US, "nodes": waiting_nodes, "waiting": waiting,
                                     "measured": queue["reading_mean_us"] if queue else None}
    targets["waiting_decision_p99_us"] = {"target": DECISION_TARGET_US, "nodes": waiting_nodes, "waiting": waiting,
                                          "measured": queue["decide_p99_us"] if queue else None}
    for t in targets.values():
        t["met"] = t["measured"] is not None and t["measured"] <= t["target"]
    if not quiet:
        d, f = targets["decision_p99_us"], targets["follow_share"]
        if d["measured"] is not None:
            print(f"\ntarget: decision p99 <= {DECISION_TARGET_US:.0f} µs at {d['nodes']} nodes, {d['tenants']} "
                  f"tenants: {d['measured']:.0f} µs ({'met' if d['met'] else 'MISSED'})")
        for key, what in (("waiting_reading_us", "a probe reading (mean)"), ("waiting_decision_p99_us",
                                                                         "decision p99")):
            w = targets[key]
            if w["measured"] is not None:
                print(f"target: {what} <= {w['target']:.0f} µs at {w['nodes']} full nodes, {w['waiting']} waiting: "
                      f"{w['measured']:.0f} µs ({'met' if w['met'] else 'MISSED'})")
        if f["measured"] is not None:
            print(f"target: following {f['nodes']} nodes at {period * 1000:.0f} ms with <= "
                  f"{FOLLOW_TARGET_SHARE:.0%} of a core ({f['mode']}): {f['measured']:.1%} "
                  f"({'met' if f['met'] else 'MISSED'})")
    return {"decision": decisions, "follow": follow, "waiting": queue, "waiting_once_per_turn": per_turn,
            "targets": targets}


def _main(argv: list[str] | None = None) -> int:
    """The simulated probes' process (``kvgate bench scale`` starts it)."""
    p = argparse.ArgumentParser(prog="python -m kvgate.bench.scale")
    p.add_argument("--serve-probes", type=int, required=True)
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    raise_file_limit()
    factory, _ = _loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve_probes(a.serve_probes, a.interval, not a.no_stream, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
