"""vLLM's OpenAI-compatible HTTP surface over the simulated engine, in real time.

``kvgate sim --profile 8b-h100 --port 8000`` serves ``/v1/chat/completions``, ``/v1/completions``
(streaming SSE, ``stream_options.include_usage``), ``/v1/models``, ``/health`` and ``/metrics``.
Tokens come out per engine step, as in vLLM: one SSE event per request per step.

No model runs, so text is filler and lengths are chosen: prompt tokens are estimated as characters
/ 4 (+4 per chat message; token-id prompts count exactly); a request produces ``max_tokens`` tokens
when ``ignore_eos`` is true, otherwise it "stops" at a seeded, geometrically distributed natural
length (mean ``--mean-output-tokens``) capped by ``max_tokens``.

Prefix caching sees the prompt's content: with no tokenizer, each 4-character chunk of text is a
stand-in token whose id is a stable hash of the chunk (and each chat message 4 template tokens), so
repeated prompts and shared leading messages hit as they would in vLLM (``sim.prefix_cache``); a
``cache_salt`` keys the first block, as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from ext_proc.profiles import Profile

from .engine import Engine, EngineOptions
from .metrics import NodeMetrics
from .prefix_cache import Prompt
from .scheduler import QueueFull, Request, Status, TokenEvent

WORDS = ("the", " model", " says", " hello", " to", " you", " and", " then", " some", " more", ".")


@dataclass
class SimOptions:
    served_model_name: str | None = None
    mean_output_tokens: int = 256
    legacy_kv_metric: bool = False
    load_seconds: float = 0.0
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters served (vLLM ``--lora-modules``): a request naming one runs with it."""


class RealtimeNode:
    """Runs an Engine against the event loop's clock; hands tokens to the requests waiting on them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = asyncio.Event()
        self._queues: dict[Request, asyncio.Queue[TokenEvent]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def submit(self, req: Request) -> asyncio.Queue[TokenEvent]:
        self.engine.add(req)  # QueueFull / ValueError propagate to the handler
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[req] = q
        self._wake.set()
        return q

    def release(self, req: Request) -> None:
        self._queues.pop(req, None)
        if req.status in (Status.WAITING, Status.RUNNING):
            self.engine.abort(req)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            dt = self.engine.begin_step(now)
            if dt is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            end = now + dt
            await asyncio.sleep(max(0.0, end - loop.time()))
            for ev in self.engine.end_step(max(end, loop.time())):
                q = self._queues.get(ev.request)
                if q is not None:
                    q.put_nowait(ev)


def _error(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": None, "code": status}},
                             status=status)


def _content_text(message: object, where: str) -> str:
    """The text of one chat message's content, validated as vLLM's request model does: ``content`` is
    a string, null, or a list of typed parts (objects with a string ``type``; text parts need a string
    ``text``). Anything else raises ValueError (a 400)."""
    if not isinstance(message, dict):
        raise ValueError(f"{where}: Input should be a valid dictionary or object")
    c = message.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise ValueError(f"{where}.content: Input should be a valid string, null or a list of content parts")
    texts = []
    for j, part in enumerate(c):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at}: Input should be a valid dictionary or object (a content part with a 'type')")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise ValueError(f"{at}.type: Field required: a content part needs a string 'type'")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{at}.text: Input should be a valid string")
            texts.append(text)
    return "".join(texts)


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    """``body[name]`` as a positive integer (None when absent or null); ValueError (a 400) otherwise.
    As vLLM's pydantic model (lax mode) reads it: an integral number is accepted, a bool or string is not
    here, and below 1 is refused as vLLM's SamplingParams refuses it."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
        raise ValueError(f"{name}: Input should be a valid integer, got {orjson.dumps(v).decode()}")
    if v < 1:
        raise ValueError(f"{name} must be at least 1, got {int(v)}.")
    return int(v)


class SimServer:
    def __init__(self, profile: Profile, engine_options: EngineOptions, options: SimOptions) -> None:
        self.profile = profile
        self.options = options
        self.model = options.served_model_name or profile.model_name
        self.engine = Engine(profile, engine_options)
        self.metrics = NodeMetrics(self.engine, self.model, options.legacy_kv_metric)
        self.node = RealtimeNode(self.engine)
        self._rng = random.Random(engine_options.seed)
        self._ids = itertools.count()
        self.policy = engine_options.policy
        self.open = 0
        self.peak = 0
        """Completions requests open at once, now and at most: what a test counts at the node."""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _: web.Application) -> None:
        self.node.start()

    async def _cleanup(self, _: web.Application) -> None:
        await self.node.stop()

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def prometheus(self, _: web.Request) -> web.Response:
        extra = ("# HELP sim_open_requests Completion requests open at this simulated node (not a vLLM metric)\n"
                 "# TYPE sim_open_requests gauge\n"
                 f"sim_open_requests {self.open}\n"
                 "# HELP sim_open_requests_peak The most completion requests ever open at once here\n"
                 "# TYPE sim_open_requests_peak gauge\n"
                 f"sim_open_requests_peak {self.peak}\n").encode()
        return web.Response(body=generate_latest(self.metrics.registry) + extra,
                            content_type="text/plain", charset="utf-8")

    async def models(self, _: web.Request) -> web.Response:
        created = int(time.time())
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": created, "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.profile.max_model_len}, *(
            # as vLLM lists its --lora-modules: the adapter, its base model as parent
            {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": name,
             "parent": self.model, "max_model_len": self.profile.max_model_len}
            for name in self.options.lora_modules)]})

    def _prompt(self, body: dict[str, Any], chat: bool) -> tuple[int, Prompt]:
        """Prompt tokens and their stand-in content; ValueError (a 400) for a request vLLM's request model
        would refuse."""
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ValueError("messages must be a non-empty list")
            texts = []
            for i, m in enumerate(msgs):
                text = _content_text(m, f"messages[{i}]")
                texts.append((str(m.get("role", "")), text))
            chars = sum(len(t) for _, t in texts)
            return 4 * len(msgs) + math.ceil(chars / 4), Prompt.from_chat(texts, salt)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt), Prompt.from_ids(prompt, salt)
        if isinstance(prompt, str):
            return max(1, math.ceil(len(prompt) / 4)), Prompt.from_text(prompt, salt)
        raise ValueError("prompt must be a string or a list of token ids")

    async def completions(self, http: web.Request) -> web.StreamResponse:
        chat = http.path.endswith("/chat/completions")
        try:
            body = orjson.loads(await http.read())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except (orjson.JSONDecodeError, ValueError) as e:
            return _error(400, f"Invalid request body: {e}")
        model = body.get("model")
        lora = model if model in self.options.lora_modules else None
        if model is not None and model != self.model and lora is None:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        priority = body.get("priority", 0)
        if not isinstance(priority, int):
            return _error(400, "priority must be an integer")
        if priority != 0 and self.policy != "priority":
            return _error(400, f"Got priority {priority} but Priority scheduling is not enabled.")
        try:
            prompt, content = self._prompt(body, chat)
            _positive_int(body, "n")
            max_tokens = _positive_int(body, "max_tokens")
            requested = _positive_int(body, "max_completion_tokens") if chat else None
        except ValueError as e:
            return _error(400, str(e))
        if requested is None:
            requested = max_tokens
        room = self.profile.max_model_len - prompt
        if room < 1:
            return _error(400, f"This model's maximum context length is {self.profile.max_model_len} tokens. "
                               f"However, you requested {prompt} tokens in the messages.")
        limit = min(requested or room, room)
        if body.get("ignore_eos") is True:
            out, reason = limit, "length"
        else:
            natural = 1 + int(self._rng.expovariate(1.0 / max(1, self.options.mean_output_tokens - 1)))
            out, reason = (natural, "stop") if natural < limit else (limit, "length")
        req = Request(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", prompt, out, self.node.now(),
                      priority, reason, content=content, lora=lora)
        try:
            queue = self.node.submit(req)
        except QueueFull:
            return _error(503, "The server's request queue is full; please retry later.", "ServiceUnavailableError")
        except ValueError as e:
            return _error(400, str(e))
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            if body.get("stream") is True:
                opts = body.get("stream_options")
                usage = isinstance(opts, dict) and opts.get("include_usage") is True
                return await self._stream(http, req, queue, chat, usage)
            return await self._complete(req, queue, chat)
        finally:
            self.open -= 1
            if req.status in (Status.WAITING, Status.RUNNING):  # the client went away
                self.metrics.finished(req, "abort")
            self.node.release(req)

    def _usage(self, req: Request) -> dict[str, Any]:
        """vLLM's usage object, with the prompt tokens its prefix cache served (``cached_tokens``, what
        vLLM reports in ``prompt_tokens_details`` when caching is on): spend budgets price them apart."""
        usage: dict[str, Any] = {"prompt_tokens": req.prompt_tokens,
                                 "total_tokens": req.prompt_tokens + req.output_tokens,
                                 "completion_tokens": req.output_tokens}
        if self.engine.scheduler.caching:
            usage["prompt_tokens_details"] = {"cached_tokens": req.cached_tokens}
        return usage

    async def _complete(self, req: Request, queue: asyncio.Queue[TokenEvent], chat: bool) -> web.Response:
        n = 0
        while True:
            ev = await queue.get()
            n += 1
            if ev.finished:
                break
        text = "".join(WORDS[i % len(WORDS)] for i in range(n))
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
             "finish_reason": req.finish_reason}
            if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason})
        doc = {"id": req.id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": self.model, "choices": [choice], "usage": self._usage(req)}
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def _stream(self, http: web.Request, req: Request, queue: asyncio.Queue[TokenEvent], chat: bool,
                      usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(http)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        head = {"id": req.id, "object": obj, "created": created, "model": self.model}
        if chat:  # vLLM's first chunk carries the role
            await resp.write(b"data: " + orjson.dumps({**head, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]}) + b"\n\n")
        i = 0
        while True:
            ev = await queue.get()
            word = WORDS[i % len(WORDS)]
            i += 1
            finish = req.finish_reason if ev.finished else None
            choice = ({"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": finish} if chat
                      else {"index": 0, "text": word, "logprobs": None, "finish_reason": finish})
            await resp.write(b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n")
            if ev.finished:
                break
        if usage:
            await resp.write(b"data: " + orjson.dumps({**head, "choices": [], "usage": self._usage(req)}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def run(profile: Profile, engine_options: EngineOptions, options: SimOptions, host: str, port: int) -> None:
    if options.load_seconds > 0:
        time.sleep(options.load_seconds)  # the model load: no port is open meanwhile, as with vLLM
    server = SimServer(profile, engine_options, options)
    web.run_app(server.app(), host=host, port=port, print=None, access_log=None)
