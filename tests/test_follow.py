"""kvgate following the probes (``ext_proc/follow.py``): over each probe's stream, real probe processes
in front of simulated vLLM nodes; a probe killed, paused or too old for the stream; the stream's deltas."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.config import parse_config
from ext_proc.follow import STREAMS_BEFORE_A_POLL, Follower
from ext_proc.nodes import Fleet, Node
from ext_proc.server import Gateway
from ext_proc.stats import FOLLOW_MODES
from gpu_probe.parse import MAX_NAMES
from gpu_probe.server import NDJSON, STREAM_PATH
from gpu_probe.snapshot import _FIELDS, NAME_LISTS, Snapshot, StreamDecoder, changes
from kvgate.dev.stack import free_port, wait_port

ADDR = "10.0.0.1:8000"


async def until(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for ``pred`` (the timeout only keeps a broken build from hanging: no test times anything)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.02)


def gateway(probe_url: str, **nodes: Any) -> Gateway:
    return Gateway(parse_config({"nodes": {"static": [{"address": ADDR, "probe": probe_url}],
                                           "poll_interval_seconds": 0.1, "stale_after_seconds": 0.5,
                                           "dead_after_seconds": 1.5, **nodes}}))


def node(gw: Gateway) -> Node:
    fleet: Fleet | None = gw.fleet
    assert fleet is not None
    return fleet.nodes[ADDR]


def status(gw: Gateway) -> str:
    fleet: Fleet | None = gw.fleet
    assert fleet is not None
    return fleet.status(node(gw), gw.core.now())


def snap(gw: Gateway) -> Snapshot:
    """The node's last reading (the test has waited for one)."""
    s = node(gw).snapshot
    assert s is not None
    return s


def watch(seen: list[str], gw: Gateway, until_status: str) -> Callable[[], bool]:
    """A condition that records every status it sees on the way to ``until_status``."""
    def check() -> bool:
        seen.append(status(gw))
        return seen[-1] == until_status
    return check


@contextlib.asynccontextmanager
async def following(gw: Gateway) -> AsyncIterator[Follower]:
    f = Follower(gw.core, gw.flush)
    task = asyncio.create_task(f.run())
    try:
        yield f
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "kvgate.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class RealProbe:
    """``kvgate sim`` (a simulated vLLM) and ``kvgate probe`` in front of it, as two processes."""

    def __init__(self) -> None:
        self.sim_port, self.port = free_port(), free_port()
        self.sim = _spawn("sim", "--port", str(self.sim_port), "--num-gpu-blocks", "100")
        self.probe: subprocess.Popen[bytes] | None = None
        wait_port(self.sim_port, proc=self.sim)
        self.start_probe()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_probe(self) -> None:
        self.probe = _spawn("probe", "--vllm", f"http://127.0.0.1:{self.sim_port}", "--port", str(self.port),
                            "--interval", "0.1")
        wait_port(self.port, proc=self.probe)

    def signal(self, sig: int) -> None:
        assert self.probe is not None
        os.kill(self.probe.pid, sig)
        if sig == signal.SIGKILL:
            self.probe.wait(10)

    def stop(self) -> None:
        for p in (self.probe, self.sim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def real_probe() -> Any:
    rp = RealProbe()
    try:
        yield rp
    finally:
        rp.stop()


async def test_kvgate_follows_a_real_probe_over_its_stream_and_sees_changes(real_probe: RealProbe) -> None:
    gw = gateway(real_probe.url)
    async with following(gw) as f, aiohttp.ClientSession() as s:
        await until(lambda: node(gw).snapshot is not None and snap(gw).ok, "a first reading")
        assert f.modes[ADDR] == "stream"
        first = snap(gw)
        assert first.blocks_total == 100 and first.running == 0 and status(gw) == "fresh"
        # a request straight to the simulated node: the probe reads it running, kvgate sees it
        body = {"prompt": "x" * 400, "max_tokens": 200, "ignore_eos": True}
        req = asyncio.ensure_future(s.post(f"http://127.0.0.1:{real_probe.sim_port}/v1/completions", json=body))
        await until(lambda: (snap(gw).running or 0) >= 1, "the request seen running")
        assert (snap(gw).kv_usage or 0) > 0
        resp = await req
        await resp.read()
        await until(lambda: snap(gw).running == 0, "the request seen finished")
        assert f.modes[ADDR] == "stream"  # all of it over the one stream


async def test_a_probe_killed_mid_stream_goes_stale_then_dead_then_is_followed_again(real_probe: RealProbe) -> None:
    gw = gateway(real_probe.url)
    seen: list[str] = []
    async with following(gw) as f:
        await until(lambda: f.modes.get(ADDR) == "stream" and status(gw) == "fresh", "streaming")
        real_probe.signal(signal.SIGKILL)
        await until(watch(seen, gw, "dead"), "the node dead")
        assert "unknown" in seen and seen.index("unknown") < seen.index("dead")  # stale first, as with polling
        assert f.modes[ADDR] == "connecting"
        real_probe.start_probe()  # back (a restart): followed again, over a stream
        await until(lambda: status(gw) == "fresh", "the node fresh again")
        assert f.modes[ADDR] == "stream"


async def test_a_stream_open_but_silent_is_no_reading(real_probe: RealProbe) -> None:
    """A paused probe (or a peer gone without closing) keeps the connection open and says nothing: the
    node ages as if its probe were gone; when it speaks again it is fresh again."""
    gw = gateway(real_probe.url)
    seen: list[str] = []
    async with following(gw) as f:
        await until(lambda: f.modes.get(ADDR) == "stream" and status(gw) == "fresh", "streaming")
        real_probe.signal(signal.SIGSTOP)
        try:
            await until(watch(seen, gw, "dead"), "the node dead")
            assert "unknown" in seen
        finally:
            real_probe.signal(signal.SIGCONT)
        await until(lambda: status(gw) == "fresh", "the node fresh again")


class OlderProbe:
    """A probe from before the stream: ``GET /snapshot`` only, its reading set by the test."""

    def __init__(self, stream_answer: str = "404") -> None:
        self.hits: Counter[str] = Counter()
        self.doc = Snapshot(node="old", at=0.0, ok=True, kv_usage=0.2).to_json()
        self.stream_answer = stream_answer
        self.runner: web.AppRunner | None = None
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, **fields: Any) -> None:
        import time

        self.doc = {**self.doc, "at": time.time(), **fields}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        if request.path == "/snapshot":
            return web.json_response(self.doc)
        if self.stream_answer == "json":  # answers every path alike (like a stub or a proxy's error page)
            return web.json_response(self.doc)
        if self.stream_answer == "garbage":  # a stream that does not start with a whole snapshot
            resp = web.StreamResponse(headers={"Content-Type": NDJSON})
            await resp.prepare(request)
            await resp.write(b'{"at": 1.0}\n')
            return resp
        if self.stream_answer == "mute":  # the whole snapshot, then nothing ever (not even a heartbeat)
            resp = web.StreamResponse(headers={"Content-Type": NDJSON})
            await resp.prepare(request)
            self.set()
            await resp.write(orjson.dumps(self.doc) + b"\n")
            await asyncio.Event().wait()
        raise web.HTTPNotFound()

    async def __aenter__(self) -> OlderProbe:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.set()
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.mark.parametrize("answer", ["404", "json"])
async def test_a_probe_without_the_stream_is_polled(answer: str) -> None:
    async with OlderProbe(answer) as old:
        gw = gateway(old.url)
        async with following(gw) as f:
            await until(lambda: node(gw).snapshot is not None, "a first reading")
            assert f.modes[ADDR] == "poll"
            old.set(kv_usage=0.6)
            await until(lambda: snap(gw).kv_usage == 0.6, "the new reading polled")
            await until(lambda: old.hits["/snapshot"] >= 5, "polls")
            assert old.hits[STREAM_PATH] == 1  # asked once (again only after STREAM_RETRY_S)
            assert status(gw) == "fresh"


async def test_a_stream_that_makes_no_sense_is_dropped_then_the_probe_polled() -> None:
    """Nothing of a broken stream reaches the core; after a few, a poll is tried, and it reads."""
    async with OlderProbe("garbage") as bad:
        gw = gateway(bad.url)
        async with following(gw) as f:
            await until(lambda: bad.hits[STREAM_PATH] >= 1, "a stream")
            assert node(gw).snapshot is None
            await until(lambda: f.modes.get(ADDR) == "poll", "polled")
            assert bad.hits[STREAM_PATH] == STREAMS_BEFORE_A_POLL  # (each dropped, connected again with backoff)
            bad.set(kv_usage=0.4)
            await until(lambda: node(gw).snapshot is not None and snap(gw).kv_usage == 0.4, "polled readings")


async def test_a_dead_probe_costs_streams_with_backoff_not_polls() -> None:
    port = free_port()  # nothing listens: refused
    gw = gateway(f"http://127.0.0.1:{port}")
    async with following(gw) as f:
        await until(lambda: f.modes.get(ADDR) == "connecting", "trying")
        await asyncio.sleep(1.0)
        assert f.modes[ADDR] == "connecting" and node(gw).snapshot is None and status(gw) == "dead"


async def test_a_stream_that_goes_mute_is_dropped_and_connected_again() -> None:
    """A peer gone without closing (a node powered off, a partition) leaves a connection that never
    says anything again: past its heartbeats kvgate gives up on it and connects again."""
    async with OlderProbe("mute") as mute:
        gw = gateway(mute.url)
        seen: list[str] = []
        async with following(gw) as f:
            await until(lambda: node(gw).snapshot is not None, "the first reading")
            assert f.modes[ADDR] == "stream"
            aging = watch(seen, gw, "never")
            await until(lambda: aging() or mute.hits[STREAM_PATH] >= 2, "a new connection")
            assert "unknown" in seen and "dead" in seen  # meanwhile: no reading, the node aged


@contextlib.asynccontextmanager
async def stream_probe() -> AsyncIterator[str]:
    """The real probe's HTTP side (``gpu_probe.server.Probe``), in process, holding one reading and
    reading nothing more: its URL."""
    import time

    from gpu_probe.server import Probe

    class Driven(Probe):
        async def _run(self) -> None:
            await asyncio.Event().wait()

    probe = Driven("http://vllm.invalid")
    probe.publish(Snapshot(node="n", at=time.time(), ok=True, kv_usage=0.3))
    runner = web.AppRunner(probe.app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_every_probe_of_a_large_fleet_is_followed_at_once() -> None:
    """aiohttp's default pool holds 100 connections: the 101st stream would wait forever."""
    async with stream_probe() as url:
        addrs = [f"10.0.1.{i}:8000" for i in range(1, 111)]
        gw = Gateway(parse_config({"nodes": {"static": [{"address": a, "probe": url} for a in addrs]}}))
        fleet = gw.fleet
        assert fleet is not None
        async with following(gw) as f:
            await until(lambda: all(fleet.nodes[a].snapshot is not None for a in addrs), "every node read")
            assert set(f.modes.values()) == {"stream"}


async def test_how_each_probe_is_followed_is_a_metric_per_pool() -> None:
    """``kvgate_probe_follow_nodes{mode,pool}``: an operator sees probes that fell back to polling (an
    older probe, a proxy that buffers) or cannot be reached without reading kvgate's logs."""
    def followed(gw: Gateway, pool: str) -> dict[str, float | None]:
        return {m: gw.stats.registry.get_sample_value("kvgate_probe_follow_nodes", {"mode": m, "pool": pool})
                for m in FOLLOW_MODES}

    refused = f"http://127.0.0.1:{free_port()}"  # nothing listens
    async with stream_probe() as streams, OlderProbe() as old:
        gw = Gateway(parse_config({
            "pools": [{"name": "small", "models": ["s"], "nodes": {"static": [
                {"address": "10.0.2.1:8000", "probe": streams}, {"address": "10.0.2.2:8000", "probe": streams},
                {"address": "10.0.2.3:8000", "probe": old.url}]}},
                {"name": "big", "models": ["b"], "nodes": {"static": [
                    {"address": "10.0.3.1:8000", "probe": refused}]}}]}))
        assert followed(gw, "small") == {"stream": None, "poll": None, "connecting": None}  # nothing follows yet
        async with following(gw) as f:
            await until(lambda: len(f.modes) == 4 and followed(gw, "small") == {"stream": 2, "poll": 1,
                                                                             "connecting": 0}, "modes settled")
            assert followed(gw, "big") == {"stream": 0, "poll": 0, "connecting": 1}
            gw.core.set_nodes([("10.0.2.4:8000", streams, None)], "big")  # discovery: a node not yet looked at
            assert followed(gw, "big") == {"stream": 0, "poll": 0, "connecting": 1}
            await until(lambda: followed(gw, "big")["stream"] == 1, "the new node streaming")


async def test_nodes_come_and_go_with_the_node_list() -> None:
    async with OlderProbe() as a, OlderProbe() as b:
        gw = gateway(a.url)
        async with following(gw) as f:
            await until(lambda: f.modes.get(ADDR) == "poll", "node a followed")
            gw.core.set_nodes([("10.0.0.2:8000", b.url, None)])  # discovery: a gone, b new
            fleet = gw.fleet
            assert fleet is not None
            await until(lambda: fleet.nodes["10.0.0.2:8000"].snapshot is not None, "node b followed")
            assert ADDR not in f.modes
            polls = a.hits["/snapshot"]
            await until(lambda: b.hits["/snapshot"] >= 5, "b polled a while")
            assert a.hits["/snapshot"] <= polls + 1  # a no longer (at most one poll was on its way)


# -- the deltas ------------------------------------------------------------------------------------


def _value(kind: type, name: str = "") -> st.SearchStrategy[Any]:
    few: st.SearchStrategy[Any]
    if name in NAME_LISTS:  # adapter names (a probe may send no other items)
        few = st.lists(st.sampled_from(["a", "b"]) | st.text(max_size=5), max_size=3)
    elif kind is float:
        few = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1e9, allow_nan=False, allow_infinity=False)
    elif kind is int:  # (max_lora is bounded: more than MAX_NAMES is a bad value)
        few = st.sampled_from([0, 16]) | st.integers(0, MAX_NAMES if name == "max_lora" else 2**53)
    elif kind is bool:
        few = st.booleans()
    elif kind is str:
        few = st.sampled_from(["a", "b"]) | st.text(max_size=5)
    else:
        few = st.lists(st.dictionaries(st.sampled_from(["model", "kv_usage"]),
                                       st.sampled_from(["m", 0.5, 1, None])), max_size=2)
    return st.none() | few


_required = {"node": st.sampled_from(["n", "m"]), "at": st.floats(0, 1e10, allow_nan=False), "ok": st.booleans()}
snapshots = st.builds(Snapshot, **{k: _required[k] if k in _required else _value(kind, k)
                                   for k, kind in _FIELDS.items()})


@settings(max_examples=300, deadline=None)
@given(st.lists(snapshots, min_size=1, max_size=8), st.data())
def test_applying_the_stream_in_order_reproduces_each_snapshot(snaps: list[Snapshot], data: st.DataObject) -> None:
    """What the probe sends (the whole first, then ``changes`` from what it sent last — readings may be
    skipped, heartbeats come between) read back by kvgate gives exactly what a poll of each would."""
    # (a real probe's readings each have their own `at`; here one may repeat, which must read as no reading)
    docs = [s.to_json() for s in snaps]
    decoder = StreamDecoder()
    sent: dict[str, Any] = {}
    for doc in docs:
        skipped: bool = data.draw(st.booleans(), "skipped by a slow reader")
        if sent and skipped:
            continue
        if data.draw(st.booleans(), "a heartbeat first"):
            assert decoder.feed(orjson.loads(b"{}")) is None
        wire = orjson.loads(orjson.dumps(changes(sent, doc)))
        got = decoder.feed(wire)
        if not wire:  # the same reading again (its `at` too): nothing new, read as a heartbeat
            assert got is None
        else:
            assert got == Snapshot.from_json(doc)
        assert decoder.last == Snapshot.from_json(doc)
        sent = doc


def test_a_stream_must_start_whole_and_carry_valid_values() -> None:
    with pytest.raises(ValueError, match="'node' is missing"):
        StreamDecoder().feed({"at": 1.0, "ok": True})
    d = StreamDecoder()
    d.feed(Snapshot(node="n", at=1.0, ok=True, kv_usage=0.5).to_json())
    for bad, field in (({"kv_usage": -1}, "kv_usage"), ({"at": None}, "at"), ({"blocks_total": True}, "blocks_total"),
                       ({"running": float("inf")}, "running"), ({"node": 3}, "node")):
        with pytest.raises(ValueError, match=field):
            d.feed(bad)
    with pytest.raises(ValueError, match="JSON object"):
        d.feed([1])
    snap = d.feed({"at": 2, "blocks_total": 10, "a_newer_field": "x"})  # ints for floats, as from_json reads them
    assert snap == Snapshot(node="n", at=2.0, ok=True, kv_usage=0.5, blocks_total=10)
    assert isinstance(snap.at, float)


async def test_a_reading_that_makes_room_answers_the_requests_waiting_for_it() -> None:
    """The follower hands the core's answers over itself (no tick runs here): a request queued while the
    node was full is admitted by the reading that shows room."""
    import time

    from ext_proc.core import Held, Request
    from ext_proc.identity import hash_key
    from gpu_probe.server import Probe

    class Driven(Probe):
        async def _run(self) -> None:
            await asyncio.Event().wait()

    probe = Driven("http://vllm.invalid")
    probe.publish(Snapshot(node="n", at=time.time(), ok=True, kv_usage=0.99, blocks_total=1000, block_size=16))
    runner = web.AppRunner(probe.app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    gw = Gateway(parse_config({
        "tenants": [{"name": "t", "api_key_sha256": [hash_key("sk-follow")]}],
        "nodes": {"static": [{"address": ADDR, "probe": f"http://127.0.0.1:{port}"}], "kv_admit_threshold": 0.5,
                  "breaker": {"kv_threshold": 1.0}}}))
    try:
        async with following(gw):
            await until(lambda: node(gw).snapshot is not None and snap(gw).kv_usage == 0.99, "full")
            held = gw.core.decide(Request(path="/v1/completions", request_id="r1", authorization="Bearer sk-follow",
                                          body=b'{"model": "m", "prompt": "hi", "max_tokens": 5}'))
            assert isinstance(held, Held)
            answer = gw.wait_for(held)
            probe.publish(Snapshot(node="n", at=time.time(), ok=True, kv_usage=0.1, blocks_total=1000, block_size=16))
            await until(answer.done, "the answer")
            assert answer.result().decision.admitted
    finally:
        await runner.cleanup()


async def test_a_follower_whose_cancellation_was_swallowed_still_stops() -> None:
    """Should a library turn the cancellation of a node's follower into an error (and the follower go
    round its loop again), the node being dropped, or kvgate stopping, still ends it."""

    class Swallowing(Follower):
        swallow = 1  # (then no more: a broken build fails the test instead of hanging it)

        async def _stream(self, session: aiohttp.ClientSession, address: str, base: str, interval: float
                          ) -> bool | None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not self.swallow:
                    raise
                self.swallow -= 1  # what no code of ours does: the test plays the library that did
            return False

    gw = gateway("http://127.0.0.1:9")
    f = Swallowing(gw.core, gw.flush)
    run = asyncio.create_task(f.run())

    def followers() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name().startswith("follow ") and not t.done()]

    await until(lambda: len(followers()) == 1, "following")
    gw.core.set_nodes([])  # the node gone
    await until(lambda: not followers(), "the dropped node's follower ended")
    gw.core.set_nodes([(ADDR, "http://127.0.0.1:9", None)])
    await until(lambda: len(followers()) == 1, "following again")
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run  # (returns: the follower it waits for ends)
    assert not followers() and f.swallow == 0


# -- probe clock skew (issue 29, bug 8) ------------------------------------------------------------------

_TICK = 1 / 64  # (dyadic: sums and differences of these near 1.8e9 are exact, so "exactly" can be asserted)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 40), st.booleans()), min_size=1, max_size=60),
       st.sampled_from([-10.0, -2.0, 2.0, 10.0, 3600.0]))
def test_a_probe_clock_skew_does_not_change_any_readings_age(steps: list[tuple[int, int, bool]],
                                                            skew: float) -> None:
    """``(interval, delay, again)`` per reading: taken ``interval`` ticks after the last, arriving ``delay``
    ticks later, ``again``: polled twice. However far the probe's clock is off, every age is the same as
    with no skew — and a reading polled again ages by the time since it first arrived."""
    from ext_proc.follow import ProbeAges

    plain, skewed = ProbeAges(), ProbeAges()
    taken = 1_800_000_000.0
    for interval, delay, again in steps:
        taken += interval * _TICK
        received = taken + delay * _TICK
        a = plain.age("n", taken, received)
        assert a == skewed.age("n", taken + skew, received)
        assert 0.0 <= a <= delay * _TICK
        if again:
            later = received + interval * _TICK
            b = plain.age("n", taken, later)
            assert b == skewed.age("n", taken + skew, later)
            assert b == a + interval * _TICK


@pytest.mark.parametrize("skew", [-10.0, 10.0])
def test_a_node_whose_probe_clock_is_skewed_is_judged_like_one_without(skew: float) -> None:
    """kvgate's node state after the same readings, arriving at the same moments, from a probe whose
    wall clock is ``skew`` seconds off and from one on time: the same freshness (2 s behind made a node
    unknown, 10 s dead) and the same bookings still counted in the KV projection (a probe clock ahead
    made readings look newer, and requests sent after one was taken came off the projection early)."""
    def run(skew: float) -> list[tuple[str, float | None, int, int]]:
        mono, wall = [100.0], [1_800_000_000.0]  # kvgate's two clocks; the probe's wall clock is wall + skew
        gw = Gateway(parse_config({"nodes": {"static": [{"address": ADDR, "probe": "http://p.invalid"}],
                                             "stale_after_seconds": 1.0, "dead_after_seconds": 3.0}}))
        gw.core._clock = lambda: mono[0]
        f = Follower(gw.core, lambda: None, wall=lambda: wall[0])
        fleet = gw.fleet
        assert fleet is not None
        seen = []
        for i in range(12):
            taken = wall[0] + skew
            delay = 0.1 * (i % 3)  # the reading's way to kvgate (some come at once: the probe's offset)
            if delay:
                # a request sent after the reading was taken, before it arrived: the reading cannot show it
                mono[0] += delay / 2
                wall[0] += delay / 2
                fleet.dispatched(ADDR, f"r{i}", 100, 80, mono[0])
                mono[0] += delay / 2
                wall[0] += delay / 2
            f._apply(ADDR, Snapshot(node="n", at=taken, ok=True, kv_usage=0.3, blocks_total=1000, block_size=16,
                                    running=1.0, waiting=0.0))
            n = node(gw)
            seen.append((status(gw), n.fresh_at, n.pending_tokens, len(n.pending)))
            mono[0] += 0.25
            wall[0] += 0.25
        return seen

    on_time = run(0.0)
    assert all(s == "fresh" for s, *_ in on_time)
    # the request sent after a reading was taken still counts after it
    assert [pending for _, _, pending, _ in on_time] == [0, 100, 100] * 4
    assert run(skew) == on_time


def test_ages_are_taken_on_kvgates_monotonic_clock() -> None:
    """(review) Ages were taken on kvgate's wall clock: an NTP step of +20 s on kvgate's host read every
    node's next readings as 20 s old — the whole fleet dead for 32 readings. Its monotonic clock never
    steps (only differences of offsets matter); with the wall clock stepping, this is what happened:"""
    import time as time_mod

    f = Follower(Gateway(parse_config({"tenants": []})).core, lambda: None)
    assert f._wall is time_mod.monotonic
    wall, at, ages = 1_000.0, 500.0, []
    for i in range(40):
        at += 0.25
        wall += 0.25 + (20.0 if i == 20 else 0.0)  # a wall clock that steps once
        ages.append(f.ages.age("n", at, wall))
    assert max(ages) >= 20.0  # (why it must not be the wall clock)
