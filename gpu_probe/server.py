"""``kvgate probe --vllm URL``: polls one vLLM server and serves its latest snapshot.

kvgate polls ``GET /snapshot`` of every probe in the background; a request never waits on a probe.
When vLLM stops answering or answers garbage, the snapshot says ``ok: false`` with the error, and its
``at`` stops moving, which kvgate reads as staleness.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from aiohttp import web

from .nvml import Nvml
from .parse import ParseError, parse
from .snapshot import Deriver, Snapshot


class Probe:
    def __init__(self, vllm_url: str, interval: float = 0.5, timeout: float = 1.0) -> None:
        self.url = vllm_url.rstrip("/")
        self.interval = interval
        self.timeout = timeout
        self.deriver = Deriver(self.url)
        self.nvml = Nvml()
        self.latest: Snapshot = self.deriver.failed("no reading yet", time.time())
        self._task: asyncio.Task[None] | None = None

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
        self.latest = snap
        return snap

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                await self.poll_once(session)
                await asyncio.sleep(self.interval)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/snapshot", self.snapshot)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _stop(self, _: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def snapshot(self, _: web.Request) -> web.Response:
        return web.json_response(self.latest.to_json())

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")


def run(vllm_url: str, host: str, port: int, interval: float, timeout: float) -> None:
    web.run_app(Probe(vllm_url, interval, timeout).app(), host=host, port=port, print=None, access_log=None)
