"""Following the probes: every node's readings into the core, each over one long-lived stream.

Why not a GET per node per period, as before: following 1,000 nodes at 250 ms is 4,000 HTTP requests a
second for kvgate to make and parse in Python — more than half a core, and at that rate it falls
behind (``kvgate bench scale``). A probe's stream (``GET /snapshot/stream``, see ``gpu_probe.server``)
costs one connection per node and, per reading, one short line: the fields that changed.

Per node, one task:

* **stream** — ``GET /snapshot/stream?interval=<the pool's poll_interval_seconds>``; each line is merged
  into the node's document (``gpu_probe.snapshot.StreamDecoder``: the same validation as a poll's) and
  goes to the core as a reading, its age taken from ``at`` exactly as for a poll;
* **silence is no reading** — the core ages a node by the time of its last reading, so a stream that
  stays open but says nothing (a paused probe, a peer gone without closing) makes the node stale, then
  dead, as unanswered polls did. A stream silent for ``SILENCE_HEARTBEATS`` heartbeats is dropped and
  connected again;
* **reconnect with backoff** — a stream that ends, or fails, is connected again after 0.1 s doubling to
  ``BACKOFF_MAX_S`` (jittered: a restarted fleet of probes is not stormed in step); a stream that
  delivered readings starts over at 0.1 s;
* **older probes** — a probe that does not offer the stream (404, or any answer that is not NDJSON:
  an older probe, or something answering every path alike) is polled as before, ``GET /snapshot``
  each interval, and asked for the stream again every ``STREAM_RETRY_S`` (it may have been upgraded).
  So is one whose streams keep delivering nothing while a poll reads (a proxy between that buffers
  responses, a broken stream): after ``STREAMS_BEFORE_A_POLL`` such streams one poll is tried.

**A reading's age is measured on kvgate's clock alone** (:class:`ProbeAges`). ``at`` is the probe host's
wall clock: ``time.time() - at`` mixed two hosts' clocks, so 2 s of skew made a node unknown, 10 s dead,
and a probe clock ahead made readings look newer than they were (bookings sent after the reading came
off the KV projection: overbooking). Per probe, kvgate keeps the offset ``received - at`` of its recent
readings; the smallest of them is the probe's clock offset plus the least delay, and a reading's age is
how much later than that it arrived. A constant skew cancels exactly; a probe clock stepped back makes
its node read older (by the step) for at most ``OFFSET_READINGS`` readings. kvgate's side is its
monotonic clock: only differences matter, and it never steps.

Readings are applied as they arrive (the core is cheap per reading); the gateway's flush (answers for
queued requests a reading may have released) runs once per event-loop turn, however many readings
arrived in it, and only when requests were waiting.
"""

from __future__ import annotations

import asyncio
import math
import random
import resource
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import orjson

from gpu_probe.server import HEARTBEAT_S, NDJSON, STREAM_PATH
from gpu_probe.snapshot import Snapshot, StreamDecoder

from . import logs

if TYPE_CHECKING:
    from .core import Core

SILENCE_HEARTBEATS = 3
"""A stream with no line for this many heartbeats (or intervals, when longer) is taken as broken."""
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
"""Reconnecting to a dead probe costs a refused connection: cheap, but 1,000 of them should not come
every 100 ms; nor should a probe that is back wait long to be followed again."""
STREAMS_BEFORE_A_POLL = 3
"""Streams in a row that delivered nothing before one poll is tried: if it reads, the probe is polled
(for ``STREAM_RETRY_S``); if not (a dead probe), streams are tried again, as cheap as failures get."""
STREAM_RETRY_S = 60.0
"""How long a probe without the stream is polled before the stream is asked for again."""
MAX_LINE = 1 << 20
"""A line longer than this is not a snapshot (a probe gone mad): the stream is dropped."""
RECONCILE_S = 0.5
"""How often the followed nodes are matched against the core's (discovery, reloads)."""
OFFSET_READINGS = 32
"""Readings (with a new ``at``) a probe's clock offset is the smallest of: enough that one with little
delay is among them (a poll lands anywhere in the probe's interval), few enough (8 s at 250 ms) that a
probe whose clock was stepped back is judged right again soon."""
SPARE_FILES = 256
"""File descriptors kept for everything else (Envoy's connections, metrics, the config file)."""

log = logs.get("kvgate.follow")


class Follower:
    """Follows the probes of every node of every pool of ``core``; ``flush`` hands the core's answers
    to their streams (``Gateway.flush``)."""

    def __init__(self, core: Core, flush: Callable[[], None], rng: random.Random | None = None,
                 wall: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self._flush = flush
        self._rng = rng or random.Random()
        self._wall = wall
        """kvgate's clock, read when a reading arrives (injected by tests): monotonic, since only
        differences of offsets matter and kvgate's wall clock can step (an NTP step of 20 s read every
        node's next readings as 20 s old: the whole fleet dead for ``OFFSET_READINGS`` readings)."""
        self.ages = ProbeAges()
        self._tasks: dict[str, tuple[tuple[str, float], asyncio.Task[None]]] = {}
        self._seen: list[object] = []
        """The fleets and node tables the followed set was built from: unchanged, nothing to do."""
        self._flush_due = False
        self._files: int | None = None
        self.modes: dict[str, str] = {}
        """Node address → how it is followed now: ``stream``, ``poll`` (a probe without the stream) or
        ``connecting`` (its stream is down or not up yet). Reported as ``kvgate_probe_follow_nodes``."""
        core.stats.follow_modes = self.modes

    async def run(self) -> None:
        self._files = raise_file_limit()
        # limit=0: a connection per probe, all open at once (aiohttp's default pool of 100 would leave
        # every stream past the hundredth waiting forever)
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                while True:
                    self._reconcile(session)
                    await asyncio.sleep(RECONCILE_S)
            finally:
                tasks = [t for _, t in self._tasks.values()]
                self._tasks.clear()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _reconcile(self, session: aiohttp.ClientSession) -> None:
        fleets = self.core.fleets
        seen: list[object] = [fleets]
        for f in fleets.values():
            seen += (f, f.nodes, f.cfg)
        if len(seen) == len(self._seen) and all(a is b for a, b in zip(seen, self._seen, strict=True)):
            return  # (a reload makes new fleets and configs, discovery a new node table: held here, never reused)
        self._seen = seen
        wanted: dict[str, tuple[str, float]] = {}
        for fleet in fleets.values():
            for n in fleet.nodes.values():
                wanted[n.address] = (n.probe, fleet.cfg.poll_interval_seconds)
        if self._files is not None and len(wanted) + SPARE_FILES > self._files:
            log.warning("probe_connections_limited", nodes=len(wanted), open_files_limit=self._files,
                        note="a connection per node: raise the open-files limit (ulimit -n) or some nodes "
                        "will not be followed (they age to unknown, then dead)")
        for address, (key, task) in list(self._tasks.items()):
            if wanted.get(address) != key:
                task.cancel()
                del self._tasks[address]
                self.modes.pop(address, None)
                self.ages.forget(address)
        for address, key in wanted.items():
            if address not in self._tasks:
                task = asyncio.create_task(self._follow(session, address, *key), name=f"follow {address}")
                self._tasks[address] = (key, task)

    # -- one node ------------------------------------------------------------------------------------

    async def _follow(self, session: aiohttp.ClientSession, address: str, probe: str, interval: float) -> None:
        base = probe.rstrip("/")
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        failures = 0
        stream_from = 0.0
        # (while it is still this node's follower: a cancellation that a library turned into an error on
        # its way out must not leave a follower running for a node gone, or hold up kvgate's shutdown)
        while (entry := self._tasks.get(address)) is not None and entry[1] is me:
            if loop.time() >= stream_from:
                self.modes[address] = "connecting"
                got = await self._stream(session, address, base, interval)
                if got is not None:
                    failures = 0 if got else failures + 1
                    # streams that deliver nothing while a poll would (a proxy between that buffers
                    # responses, a probe whose stream is broken): followed by polls a while
                    tried = failures and failures % STREAMS_BEFORE_A_POLL == 0
                    if not (tried and await self._poll(session, address, base, interval)):
                        delay = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** min(failures, 8))
                        await asyncio.sleep(delay * self._rng.uniform(0.8, 1.2))
                        continue
                stream_from = loop.time() + STREAM_RETRY_S
                self.modes[address] = "poll"
            started = loop.time()
            await self._poll(session, address, base, interval)
            await asyncio.sleep(max(0.0, started + interval - loop.time()))

    async def _stream(self, session: aiohttp.ClientSession, address: str, base: str, interval: float) -> bool | None:
        """Follow the node's stream until it ends: True if readings came over it, False if none did,
        None if the probe does not offer one."""
        heartbeat = HEARTBEAT_S
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=_connect_timeout(interval),
                                        sock_read=SILENCE_HEARTBEATS * max(heartbeat, interval))
        got = False
        try:
            async with session.get(base + STREAM_PATH, params={"interval": str(interval), "heartbeat": str(heartbeat)},
                                   timeout=timeout) as r:
                if r.status != 200 or r.content_type != NDJSON:
                    return None
                decoder = StreamDecoder()
                rest = b""
                mine = self._tasks.get(address)
                async for chunk in r.content.iter_any():  # (cheaper than line by line: a chunk is a line or more)
                    if self._tasks.get(address) is not mine:
                        break  # no longer this node's follower (see _follow)
                    lines = (rest + chunk if rest else chunk).split(b"\n")
                    rest = lines.pop()
                    if len(rest) > MAX_LINE:
                        raise ValueError(f"a line of over {MAX_LINE} bytes")
                    newest = None
                    for line in lines:
                        newest = decoder.feed(orjson.loads(line)) or newest
                    if newest is not None:
                        # of readings that arrived together (kvgate fell behind) only the newest goes to
                        # the core, as a poll would have seen only it: a backlog costs less, not more
                        if not got:
                            got = True
                            self.modes[address] = "stream"
                        self._apply(address, newest)
            self.core.node_failed(address, "the probe's stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # refused, reset, silent too long, a line that makes no sense
            self.core.node_failed(address, _why(e))
        return got

    async def _poll(self, session: aiohttp.ClientSession, address: str, base: str, interval: float) -> bool:
        """One ``GET /snapshot``, as kvgate followed every probe before the stream: whether it gave a reading."""
        try:
            async with session.get(base + "/snapshot",
                                   timeout=aiohttp.ClientTimeout(total=_connect_timeout(interval))) as r:
                doc = await r.json(content_type=None)
            self._apply(address, Snapshot.from_json(doc))
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.core.node_failed(address, _why(e))
            return False

    def _apply(self, address: str, snap: Snapshot) -> None:
        core = self.core
        waiting = core.queued or core.admission.has_outcomes  # (a reading decides only requests that wait)
        core.snapshot(address, snap, self.ages.age(address, snap.at, self._wall()))
        if waiting and not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_once)

    def _flush_once(self) -> None:
        self._flush_due = False
        self._flush()


class ProbeAges:
    """How old each probe's readings are when they arrive, without comparing two hosts' clocks (see the
    module's docstring). Pure: the receive time is passed in."""

    def __init__(self, readings: int = OFFSET_READINGS) -> None:
        self._readings = readings
        self._offsets: dict[str, deque[float]] = {}
        """Probe → ``received - at`` of its last readings with a new ``at``, oldest first."""
        self._last_at: dict[str, float] = {}

    def age(self, address: str, at: float, received: float) -> float:
        """Seconds the reading taken at ``at`` (the probe's clock) was old when it arrived at
        ``received`` (kvgate's clock): 0 for the promptest of its recent readings. A reading polled
        again (same ``at``) is not a new sample: it ages as the time since it was first seen grows."""
        offset = received - at
        if not math.isfinite(offset):
            return 0.0
        offsets = self._offsets.get(address)
        if offsets is None:
            offsets = self._offsets[address] = deque(maxlen=self._readings)
        if self._last_at.get(address) != at:
            self._last_at[address] = at
            offsets.append(offset)
        return max(0.0, offset - min(offsets))

    def forget(self, address: str) -> None:
        """The node is no longer followed: a probe followed again may run on another host's clock."""
        self._offsets.pop(address, None)
        self._last_at.pop(address, None)


def raise_file_limit() -> int | None:
    """A connection per node: a 1,000-node fleet needs more file descriptors than the soft limit many
    systems start processes with (1,024). It is raised to the hard limit, as Go's runtime does for every
    program. Returns the limit now (None: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return None if soft == resource.RLIM_INFINITY else soft


def _connect_timeout(interval: float) -> float:
    """As the poller always had: twice the interval, within 0.2 to 1 s."""
    return max(0.2, min(1.0, 2 * interval))


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
