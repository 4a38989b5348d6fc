"""``kvgate probe --vllm URL``: polls one vLLM server and serves its latest snapshot.

kvgate follows every probe in the background; a request never waits on a probe. Two ways, the same
snapshots:

* ``GET /snapshot`` — the latest snapshot as one JSON object (what kvgate polls on a probe without
  the stream, and what a person or a script reads);
* ``GET /snapshot/stream`` — newline-delimited JSON over one long-lived response: the full snapshot
  first, then at each of the probe's reads only the fields that changed (``snapshot.changes``: a
  reading always moves ``at``), and ``{}`` as a heartbeat when no line went out for ``heartbeat``
  seconds. ``?interval=S`` asks for at most one line per S seconds (the latest reading then; kvgate
  asks for its ``poll_interval_seconds``), ``?heartbeat=S`` for another heartbeat period. One
  connection per kvgate replica instead of a GET per period: following 1,000 nodes at 250 ms by
  polling is 4,000 HTTP requests a second for kvgate to make and parse.

When vLLM stops answering or answers garbage, the snapshot says ``ok: false`` with the error, and its
``at`` stops moving, which kvgate reads as staleness.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from .nvml import Nvml
from .parse import ParseError, parse
from .snapshot import Deriver, Snapshot, changes

HEARTBEAT_S = 1.0
"""The stream's default heartbeat: ``{}`` after this long without a line."""
STREAM_PATH = "/snapshot/stream"
NDJSON = "application/x-ndjson"


class Probe:
    def __init__(self, vllm_url: str, interval: float = 0.5, timeout: float = 1.0) -> None:
        self.url = vllm_url.rstrip("/")
        self.interval = interval
        self.timeout = timeout
        self.deriver = Deriver(self.url)
        self.nvml = Nvml()
        self.latest: Snapshot = self.deriver.failed("no reading yet", time.time())
        self._task: asyncio.Task[None] | None = None
        self._doc: dict[str, Any] | None = None
        """``latest`` as JSON, made once per reading however many streams send it."""
        self._changed = asyncio.Event()
        """Set when a reading replaces ``latest``; replaced by a fresh one at each reading, so a stream
        waits on the event of the reading it last sent."""
        self._closing = asyncio.Event()
        """Set at shutdown: streams end at once (the server would otherwise wait out its shutdown
        timeout for responses that never end by themselves)."""

    def publish(self, snap: Snapshot) -> None:
        """A new reading: what ``GET /snapshot`` answers from now on, and what every stream sends next."""
        self.latest = snap
        self._doc = None
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def document(self) -> dict[str, Any]:
        if self._doc is None:
            self._doc = self.latest.to_json()
        return self._doc

    async def poll_once(self, session: aiohttp.ClientSession) -> Snapshot:
        now = time.time()
        try:
            async with session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status != 200:
                    raise ParseError(f"vLLM /metrics answered HTTP {r.status}")
                text = await r.text()
            snap = self.deriver.update(parse(text), now, self.nvml.read())
        except (aiohttp.ClientError, TimeoutError, ParseError) as e:
            snap = self.deriver.failed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, now)
        self.publish(snap)
        return snap

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                await self.poll_once(session)
                await asyncio.sleep(self.interval)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/snapshot", self.snapshot)
        app.router.add_get(STREAM_PATH, self.stream)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _shutdown(self, _: web.Application) -> None:
        self._closing.set()
        self._changed.set()  # wakes every stream waiting for a reading

    async def _stop(self, _: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def snapshot(self, _: web.Request) -> web.Response:
        return web.json_response(self.latest.to_json())

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """``GET /snapshot/stream``: see the module's docstring. A slow reader is never queued for: a
        line waits for the previous one to be written, then carries what changed since *it* (the
        readings in between are folded into one line)."""
        try:
            interval = _seconds(request.query.get("interval"), 0.0)
            heartbeat = max(0.05, _seconds(request.query.get("heartbeat"), HEARTBEAT_S))
        except ValueError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-store"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        try:
            changed = self._changed
            sent = self.document()
            await resp.write(orjson.dumps(sent) + b"\n")
            last = loop.time()
            while not self._closing.is_set():
                if not changed.is_set():
                    try:
                        async with asyncio.timeout(max(0.0, last + heartbeat - loop.time())):
                            await changed.wait()
                    except TimeoutError:
                        await resp.write(b"{}\n")
                        last = loop.time()
                        continue
                    if self._closing.is_set():
                        break
                wait = last + interval - loop.time()
                if wait > 0:  # at most one line per interval: the latest reading when it is due
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await self._closing.wait()
                    if self._closing.is_set():
                        break
                changed = self._changed
                doc = self.document()
                await resp.write(orjson.dumps(changes(sent, doc)) + b"\n")
                sent, last = doc, loop.time()
        except ConnectionError:
            pass  # the reader went away
        return resp

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")


def _seconds(raw: str | None, default: float) -> float:
    if raw is None:
        return default
    v = float(raw)
    if not 0 <= v <= 60:  # (also refuses NaN)
        raise ValueError(f"expected seconds between 0 and 60, got {raw!r}")
    return v


def run(vllm_url: str, host: str, port: int, interval: float, timeout: float) -> None:
    web.run_app(Probe(vllm_url, interval, timeout).app(), host=host, port=port, print=None, access_log=None)
