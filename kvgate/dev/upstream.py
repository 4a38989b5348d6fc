"""A small OpenAI-compatible stand-in upstream, for the local stack and tests until sim/ lands.

Behaves like vLLM's OpenAI server where kvgate can tell: chat and text completions, streaming SSE
with ``stream_options.include_usage`` (the usage chunk has empty ``choices``), the ``usage`` object,
``/v1/models``, ``/health``. Output length is ``max_tokens`` (default 16); each token takes
``token_ms``. A ``model`` of ``fail-500`` answers 500 and ``fail-400`` answers 400 (vLLM's error
shape), so upstream errors can be exercised. ``/debug/requests`` lists what it received.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

MODEL = "standin-8b"


def _prompt_tokens(body: dict[str, Any]) -> int:
    if isinstance(body.get("messages"), list):
        text = "".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    else:
        text = str(body.get("prompt", ""))
    return max(1, math.ceil(len(text) / 4))


class Upstream:
    def __init__(self, token_ms: float = 2.0, first_token_ms: float = 5.0) -> None:
        self.token_ms = token_ms
        self.first_token_ms = first_token_ms
        self.received: list[dict[str, Any]] = []
        self.active = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/debug/requests", self.debug)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "kvgate"}]}
        )

    async def debug(self, _: web.Request) -> web.Response:
        return web.json_response({"requests": self.received[-200:], "active": self.active})

    async def completions(self, req: web.Request) -> web.StreamResponse:
        raw = await req.read()
        self.received.append({
            "path": req.path,
            "headers": {k.lower(): v for k, v in req.headers.items()},
            "body": raw.decode(errors="replace"),
        })
        try:
            body = orjson.loads(raw)
            assert isinstance(body, dict)
        except Exception:
            return _error(400, "Invalid JSON body")
        model = str(body.get("model", MODEL))
        if model == "fail-500":
            return _error(500, "simulated engine failure", "InternalServerError")
        if model == "fail-400":
            return _error(400, "simulated bad request")
        chat = req.path.endswith("/chat/completions")
        n_out = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        n_out = max(0, int(n_out))
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": n_out,
                 "total_tokens": _prompt_tokens(body) + n_out}
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        self.active += 1
        try:
            if body.get("stream") is True:
                return await self._stream(req, body, rid, created, model, chat, n_out, usage)
            await asyncio.sleep((self.first_token_ms + self.token_ms * n_out) / 1000)
            text = " tok" * n_out
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat else {"index": 0, "text": text, "finish_reason": "length"}
            )
            return web.json_response({
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": usage,
            }, dumps=lambda o: orjson.dumps(o).decode())
        finally:
            self.active -= 1

    async def _stream(self, req: web.Request, body: dict[str, Any], rid: str, created: int, model: str,
                      chat: bool, n_out: int, usage: dict[str, int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(req)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(doc: dict[str, Any]) -> None:
            await resp.write(b"data: " + orjson.dumps(doc) + b"\n\n")

        await asyncio.sleep(self.first_token_ms / 1000)
        for i in range(n_out):
            delta: dict[str, Any] = {"content": " tok"}
            if chat and i == 0:
                delta["role"] = "assistant"
            last = i == n_out - 1
            choice = ({"index": 0, "delta": delta, "finish_reason": "length" if last else None} if chat
                      else {"index": 0, "text": " tok", "finish_reason": "length" if last else None})
            await send({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})
            if self.token_ms:
                await asyncio.sleep(self.token_ms / 1000)
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage") is True:
            await send({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _error(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": None, "code": status}},
                             status=status)


def run(host: str, port: int, token_ms: float) -> None:
    web.run_app(Upstream(token_ms=token_ms).app(), host=host, port=port, print=None, access_log=None)
