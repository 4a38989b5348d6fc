"""How many tokens a request will cost, estimated before it runs — and whether it is a request at all.

No tokenizer is downloaded: by default a token is ``chars_per_token`` characters of text (4.0, the
usual figure for English with GPT/Llama-style BPE vocabularies; code and CJK text run denser, so
set it lower for such traffic). A local ``tokenizer.json`` can be configured for exact counts.
The estimate only has to be good enough to *reserve* budget: the real usage reported by the
server replaces it when the response ends.

Pure and total: for any body, :meth:`Estimator.estimate` returns an :class:`Estimate` or raises
:class:`~ext_proc.reasons.Invalid` (``invalid-body``, ``invalid-parameter``, ``context-too-long``)
naming the parameter at fault; nothing else. Nothing here recurses on the client's document: the
nesting is checked (:data:`MAX_JSON_DEPTH`) and walked with an explicit stack.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from .config import Estimation, Limits
from .document import LOOK, Found, Look, TokenIds, loads
from .reasons import Invalid

try:  # intake's C extension (``_jsonscan.c``): the per-element loops below at C speed
    from ._jsonscan import all_ints as _all_ints
    from ._jsonscan import bad_message as _bad_message
    from ._jsonscan import walk_tokens as _walk_tokens
except ImportError:  # installed without a C compiler: the Python loops, the same answers, slower
    _all_ints = _bad_message = _walk_tokens = None  # type: ignore[assignment]

IMAGE_PART_TOKENS = 768
"""Reservation for one image/audio/file content part; their payloads (base64, URLs) say nothing of tokens."""

MAX_JSON_DEPTH = 64
"""Deepest nesting a request body may have (the top-level object is level 1). OpenAI requests nest a
handful of levels, tool JSON schemas a few more; orjson itself accepts 1024."""

_OPAQUE_PARTS = frozenset({"image_url", "input_audio", "input_image", "file", "input_file", "image", "audio"})
"""Content-part keys (and ``type`` values) whose payload is media, counted flat."""

Route = Literal["chat", "completions", "responses", "embeddings"]

ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
}
"""The inference routes, by path. Other paths get a lenient estimate (old behaviour): output is
reserved when the path ends with ``/completions`` or ``/responses``."""

_PROMPT_FIELD: dict[Route, str] = {"chat": "messages", "completions": "prompt", "responses": "input",
                                   "embeddings": "input"}


def route_of(path: str) -> Route | None:
    """The route kind of a request path (query string and a trailing slash ignored); None: not one of ours."""
    p = path.split("?", 1)[0].split("#", 1)[0]
    if len(p) > 1:
        p = p.rstrip("/")
    return ROUTES.get(p)


@dataclass(frozen=True, slots=True)
class Estimate:
    prompt_tokens: int
    output_tokens: int
    """Output reserved for this request: max_tokens (or the default) times the number of choices."""
    parsed: bool
    """False when the body was not JSON (or, off the inference routes, not an object): then the
    estimate comes from its size alone."""
    stream: bool = False
    include_usage: bool = False
    """True when the final usage will come without kvgate asking: the client asked for the usage chunk
    (``stream_options.include_usage``), or the route always reports it (Responses API)."""
    document: dict[str, Any] | None = None
    continuous_usage: bool = False
    """True when the client asked for ``stream_options.continuous_usage_stats`` (usage in every chunk)."""
    route: Route | None = None
    """The route kind the body was read as; None for a path that is not an inference route."""
    prefix: tuple[int, ...] = ()
    """The chain of the prompt's leading blocks (``prefix.py``), when kvgate tracks prefix caches."""
    model: str | None = None
    """The body's ``model`` (None: absent or not a string)."""
    pool: str = ""
    """The pool the core routed it to (``pools.py``); "" before routing."""

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.output_tokens


class Estimator:
    def __init__(self, cfg: Estimation, limits: Limits | None = None) -> None:
        self._ratio = cfg.chars_per_token
        self._per_message = cfg.per_message_tokens
        self._limits = limits if limits is not None else Limits()
        self._encode: Callable[[str], int] | None = None
        if cfg.tokenizer_json is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(cfg.tokenizer_json))
            self._encode = lambda s: len(tok.encode(s, add_special_tokens=False).ids)

    def text_tokens(self, chars: int, text: str | None = None) -> int:
        if self._encode is not None and text is not None:
            return self._encode(text)
        return math.ceil(chars / self._ratio)

    def estimate(self, body: bytes, *, path: str, default_max_tokens: int,
                 depth_bound: int | None = None, ids: Found | Look | None = LOOK) -> Estimate:
        """Estimate a request from its raw body and its path (query string allowed).

        Chat/completions/responses reserve output tokens; embeddings reserve none. A JSON body that is
        not a valid request of its route raises :class:`Invalid`. On an inference route every body is
        read or refused: an empty one is ``missing-body``, one that is not JSON ``invalid-json`` naming
        why (:func:`not_json`). Only other paths (the generated Envoy config sends none here) keep the
        old size-only estimate (``parsed=False``). ``intake.scan``, which the core runs first, bounds
        what the parse and the walks below can cost; what it returns, given as ``depth_bound`` (an upper
        bound on the nesting: the C pass's exact depth, or the pure-Python pass's count of objects and
        arrays), spares the nesting check a pass over the body when it is no more than
        :data:`MAX_JSON_DEPTH`. ``ids`` is ``document.find_ids``'s answer where intake has it (a large
        token-id prompt is kept raw, ``document.py``).
        """
        route = route_of(path)
        generates = _generates(path, route)
        limits = self._limits
        default_out = self._default_out(default_max_tokens)
        is_json = False
        doc: Any = None
        if body:
            try:
                doc, is_json = loads(body, route, ids), True
            except orjson.JSONDecodeError as e:
                if route is not None:
                    # never "not JSON, pass it on" on an inference route: Python's json (FastAPI inside
                    # vLLM) reads some bodies orjson refuses, and such a body would bypass every check
                    raise not_json(body, e) from None
                if "depth" in str(e) or "recursion" in str(e):
                    raise too_deep() from None
        elif route is not None:
            raise Invalid("missing-body", "This endpoint needs a JSON request body.")
        if not isinstance(doc, dict):
            if route is not None and is_json:
                raise Invalid("invalid-body", f"The request body must be a JSON object, not {_kind(doc)}.")
            return self.unparsed(body, path=path, default_max_tokens=default_max_tokens)
        if depth_bound is None:  # (a body with at most MAX_JSON_DEPTH opening brackets cannot be deeper)
            depth_bound = body.count(b"{") + body.count(b"[")
        if depth_bound > MAX_JSON_DEPTH and nesting_exceeds(body, MAX_JSON_DEPTH):
            raise too_deep()
        model = doc.get("model")
        if isinstance(model, str) and len(model) > limits.max_model_name_chars:
            # before anything keys a cache, a log line or a message on it (a pattern pool matches any length)
            raise Invalid("invalid-parameter", f"'model' is {len(model)} characters long; this gateway accepts "
                          f"model names of at most {limits.max_model_name_chars}.", "model")

        prompt = self._prompt_tokens(doc, route)
        output = 0
        out_param = "max_output_tokens" if route == "responses" else "max_tokens"
        per_choice = 0
        if generates:
            requested: int | None = None
            names = ("max_output_tokens",) if route == "responses" else ("max_completion_tokens", "max_tokens")
            for name in names:
                value = self._max_tokens(doc, name)
                if value is not None and requested is None:
                    requested, out_param = value, name
            choices = 1
            if route != "responses":
                choices = max(self._count(doc, "n"), self._count(doc, "best_of"))
            batch = _batch(doc.get("prompt")) if route == "completions" else 1
            if batch > 1:
                # a list of prompts runs one sequence per prompt (times n): reserved, and capped, as many
                # (red team: 100 prompts were reserved, and counted against max_n, as one)
                if batch * choices > limits.max_n:
                    raise Invalid("invalid-parameter", f"A batch of {batch} prompts x n={choices} is "
                                  f"{batch * choices} sequences; this gateway allows at most {limits.max_n} "
                                  "per request (limits.max_n).", "prompt")
                choices *= batch
            low = doc.get("min_tokens")
            top = limits.max_output_tokens
            if top is not None and isinstance(low, int) and not isinstance(low, bool) and low > top:
                raise Invalid("invalid-parameter", f"'min_tokens' is {low}; this gateway allows at most {top}.",
                              "min_tokens")
            per_choice = default_out if requested is None else requested
            ctx = limits.model_context_tokens
            if ctx is not None:
                # the context holds one sequence: a batch's longest prompt, not their sum
                seq = self._longest(doc.get("prompt")) if batch > 1 else prompt
                if seq >= ctx:
                    raise _context(seq, 0, ctx, _PROMPT_FIELD[route] if route is not None else "prompt")
                if seq + per_choice > ctx:
                    if requested is not None:
                        raise _context(seq, per_choice, ctx, out_param)
                    per_choice = ctx - seq  # the default never pushes a request out; the server caps it too
            output = per_choice * choices
        elif limits.model_context_tokens is not None and prompt > limits.model_context_tokens and \
                (seq := self._longest(doc.get("input"))) > limits.model_context_tokens:
            raise _context(seq, 0, limits.model_context_tokens, "input")  # (each input is its own sequence)

        stream = doc.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise Invalid("invalid-parameter", f"'stream' must be true or false, not {_kind(stream)}.", "stream")
        opts = doc.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise Invalid("invalid-parameter", f"'stream_options' must be an object, not {_kind(opts)}.",
                          "stream_options")
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        continuous = isinstance(opts, dict) and opts.get("continuous_usage_stats") is True
        if route == "responses":
            include_usage = True  # the Responses API always ends a stream with response.completed + usage
        return Estimate(prompt, output, True, stream is True, include_usage, doc, continuous, route,
                        model=model if isinstance(model, str) else None)

    def unparsed(self, body: bytes, *, path: str, default_max_tokens: int) -> Estimate:
        """The size-only estimate (``parsed=False``) of a body on a path that is not one of the inference
        routes and that is not read: not JSON, or (``intake.scan``) too costly to read."""
        route = route_of(path)
        return Estimate(self.text_tokens(len(body)),
                        self._default_out(default_max_tokens) if _generates(path, route) else 0,
                        parsed=False, route=route)

    def _default_out(self, default_max_tokens: int) -> int:
        hi = self._limits.max_output_tokens
        return default_max_tokens if hi is None else min(default_max_tokens, hi)

    # -- parameters ------------------------------------------------------------------------------

    def _longest(self, value: Any) -> int:
        """Tokens of the longest item of a batch (a list of strings or of token-id lists; anything else
        is one item): each is its own sequence, and only it must fit the context."""
        if type(value) is TokenIds:
            return value.longest
        if _batch(value) > 1:
            if type(value[0]) is not str:
                return max(map(len, value))  # (token-id lists: the prompt's own check made them so)
            if self._encode is None:
                # the longest string's tokens, not each string's (65k inputs cost 11 ms one call each)
                return self.text_tokens(max(map(len, value)))
            return max(map(self._encode, value))
        return self._token_input(value, "input")

    def _count(self, doc: dict[str, Any], name: str) -> int:
        """``n`` / ``best_of``: absent or null is 1; otherwise an integer in 1..limits.max_n."""
        value = doc.get(name)
        if value is None:
            return 1
        hi = self._limits.max_n
        if not _is_int(value) or not 1 <= value <= hi:
            raise Invalid("invalid-parameter", f"'{name}' must be an integer from 1 to {hi}, not {_show(value)}.",
                          name)
        return int(value)

    def _max_tokens(self, doc: dict[str, Any], name: str) -> int | None:
        """An output cap: absent or null is None (the default applies); otherwise a positive integer."""
        value = doc.get(name)
        if value is None:
            return None
        hi = self._limits.max_output_tokens
        if not _is_int(value) or value < 1:
            raise Invalid("invalid-parameter", f"'{name}' must be a positive integer, not {_show(value)}.", name)
        if hi is not None and value > hi:
            raise Invalid("invalid-parameter", f"'{name}' is {value}; this gateway allows at most {hi}.", name)
        return int(value)

    # -- the prompt ------------------------------------------------------------------------------

    def _prompt_tokens(self, doc: dict[str, Any], route: Route | None) -> int:
        if route == "chat":
            if "messages" not in doc:
                raise Invalid("invalid-body", "'messages' is required.", "messages")
            return self._messages(doc.get("messages"), "messages", chat=True) + self._tools(doc)
        if route == "completions":
            return self._token_input(doc.get("prompt"), "prompt")
        if route == "embeddings":
            if doc.get("input") is None and doc.get("messages") is not None:  # vLLM's chat-style embeddings
                return self._messages(doc["messages"], "messages", chat=True)
            if doc.get("input") is None:
                raise Invalid("invalid-body", "'input' is required.", "input")
            return self._token_input(doc["input"], "input")
        if route == "responses":
            total = 0
            instructions = doc.get("instructions")
            if instructions is not None:
                if not isinstance(instructions, str):
                    raise Invalid("invalid-body", f"'instructions' must be a string, not {_kind(instructions)}.",
                                  "instructions")
                total += self.text_tokens(len(instructions), instructions)
            value = doc.get("input")
            if isinstance(value, str):
                total += self.text_tokens(len(value), value)
            elif value is not None:
                total += self._messages(value, "input", chat=False)
            return total + self._tools(doc)
        # not an inference route of ours: count what is there, as leniently as before
        messages = doc.get("messages")
        if isinstance(messages, list):
            return sum(self._per_message + self._walk(m) for m in messages) + self._walk(doc.get("tools"))
        for name in ("prompt", "input"):
            if doc.get(name) is not None:
                try:
                    return self._token_input(doc[name], name)
                except Invalid:
                    return self._walk(doc[name])
        return 0

    def _walk_c(self, value: Any) -> int | None:
        """:meth:`_walk` in C (None: without the extension, or for a type orjson does not make); with a
        tokenizer the C walk gathers the strings and the tokenizer counts each (exactly: spend budgets
        rely on a prompt estimate not below the real prompt)."""
        if _walk_tokens is None:
            return None
        if self._encode is None:
            return _walk_tokens(value, self._ratio, _OPAQUE_PARTS, _SKIPPED_KEYS, IMAGE_PART_TOKENS)
        strings: list[str] = []
        media = _walk_tokens(value, 1.0, _OPAQUE_PARTS, _SKIPPED_KEYS, IMAGE_PART_TOKENS, strings)
        return None if media is None else media + sum(map(self._encode, filter(None, strings)))

    def _tools(self, doc: dict[str, Any]) -> int:
        return self._walk(doc.get("tools"))

    def _messages(self, value: Any, param: str, *, chat: bool) -> int:
        """Chat ``messages`` or Responses ``input`` items: a list of objects, each content a string, null
        or a list of typed parts."""
        if not isinstance(value, list):
            want = "a list of messages" if chat else "a string or a list of input items"
            raise Invalid("invalid-body", f"'{param}' must be {want}, not {_kind(value)}.", param)
        per_message = self._per_message
        ratio = self._ratio if self._encode is None else None
        if _bad_message is not None:
            bad = _bad_message(value, chat)
            if bad < 0:
                # every message passes the checks below (in C): the walk of them all is their tokens — what
                # the loop below counts, message by message (16k messages of an unusual shape, each walked
                # on its own, cost 27-38 ms; in C, about 2)
                walked = self._walk_c(value)
                if walked is not None:
                    return per_message * len(value) + walked
            else:
                # the one it found, named as the loop below would (the loop then walked every message
                # before it: 11 ms for 16k and a bad last one); one C leaves to Python (a dict subclass,
                # a key not a str: orjson makes neither) passes here and the loop decides
                _check_message(value[bad], f"{param}[{bad}]", chat)
        total = 0
        for i, m in enumerate(value):
            if ratio is not None and type(m) is dict and len(m) == 2:
                # the usual message, {"role": "...", "content": "..."}: what the general path below
                # counts for it, without its walk (most of an estimate's cost)
                role, content = m.get("role"), m.get("content")
                if type(role) is str:
                    if type(content) is str:
                        total += per_message + math.ceil(len(content) / ratio)
                        continue
                    if type(content) is list:
                        # ... or its content as text parts, [{"type": "text", "text": "..."}, ...]: one
                        # loop, no list built (a body of 5,400 such messages is one the scan lets through)
                        parts = 0
                        for p in content:
                            if type(p) is dict and len(p) == 2 and p.get("type") == "text":
                                t = p.get("text")
                                if type(t) is str:
                                    parts += math.ceil(len(t) / ratio)
                                    continue
                            break
                        else:
                            total += per_message + parts
                            continue
            _check_message(m, f"{param}[{i}]", chat)
            total += self._per_message + self._walk(m)
        return total

    def _token_input(self, value: Any, param: str) -> int:
        """``prompt`` / embeddings ``input``: a string, a list of strings, token ids, or a list of token-id lists."""
        if value is None:
            return 0
        if isinstance(value, str):
            return self.text_tokens(len(value), value)
        if type(value) is TokenIds:  # (read in C, every item an id: ``document.py``)
            return value.total
        bad = Invalid("invalid-body", f"'{param}' must be a string, a list of strings, a list of token ids or a "
                      f"list of token-id lists.", param)
        if not isinstance(value, list):
            raise bad
        if len(value) >= _LONG and _only_ints(value):  # the long token-id prompt, twice as fast
            return len(value)
        # the element types at C speed (``map(type, ...)``): a token-id prompt of 100k ids is checked
        # in a fraction of a Python loop's time. orjson makes exact str/int/list (a bool is not an int)
        kinds = set(map(type, value))
        if kinds <= _STR:
            walked = self._walk_c(value)
            return walked if walked is not None else sum(self.text_tokens(len(x), x) for x in value)
        if kinds == _INT:
            return len(value)
        if kinds == _LIST and (all(map(_all_ints, value)) if _all_ints is not None
                               else all(set(map(type, x)) <= _INT for x in value)):
            return sum(map(len, value))
        raise bad

    def _walk(self, value: Any) -> int:
        """Tokens of every string inside a value (content, names, tool calls, schemas); media parts count
        flat. Iterative: the client's nesting never becomes Python recursion (and was checked before,
        :func:`nesting_exceeds`). orjson makes exact dicts, lists and strs, so ``type(x) is`` suffices.

        In C (``_jsonscan.walk_tokens``, the same rules) where the extension was built (:meth:`_walk_c`;
        with a tokenizer it gathers the strings): at 1-2 µs a container in Python, 16k messages of an
        unusual shape cost 27-38 ms. The loop below is the fallback and the reference the tests hold the
        C walk to. Why it is written so: the strings are gathered and counted at the end by length
        (``Counter``), and an object without a media or ``type``/``role`` key is read through
        ``values()`` without a copy."""
        walked = self._walk_c(value)
        if walked is not None:  # (None: a type orjson does not make — the loop below decides)
            return walked
        if isinstance(value, str):
            return self.text_tokens(len(value), value)
        total = 0
        strings: list[str] = []
        stack: list[Any] = [value]
        pop, push, add = stack.pop, stack.append, strings.append
        opaque, skipped = _OPAQUE_PARTS, _SKIPPED_KEYS
        while stack:
            v = pop()
            if type(v) is dict or isinstance(v, dict):  # (the value walked may be a subclass; what is in it not)
                if not v:
                    continue
                kind = v.get("type")
                if type(kind) is str and kind in opaque:
                    total += IMAGE_PART_TOKENS
                    continue
                items: Any = v.values()
                if not (opaque.isdisjoint(v) and skipped.isdisjoint(v)):
                    keep: list[Any] = []
                    for k, x in v.items():
                        if k in opaque:
                            total += IMAGE_PART_TOKENS
                        elif k != "type" and k != "role":
                            keep.append(x)
                    items = keep
            elif isinstance(v, list):
                if len(v) > 16:  # a long list of strings or of numbers costs no Python loop
                    kinds = set(map(type, v))
                    if kinds == _STR:
                        strings += v
                        continue
                    if str not in kinds and not kinds & _NESTED:
                        continue
                items = v
            else:
                continue
            for x in items:
                t = type(x)
                if t is str:
                    add(x)
                elif t is dict or t is list:
                    push(x)
        if self._encode is not None:
            return total + sum(map(self._encode, filter(None, strings)))
        # the same ceil(len / ratio) per string, once per distinct length (strings of distinct lengths
        # need their squares' bytes: a 4 MiB body has fewer than 3,000 of them)
        ratio = self._ratio
        return total + sum(n * math.ceil(length / ratio) for length, n in Counter(map(len, strings)).items())


_LONG = 1024
"""A list at least this long is first checked for integers only by :func:`_only_ints`."""
_INT_CHARS = b"0123456789,-"


def _only_ints(value: list[Any]) -> bool:
    """Whether a list (made by orjson) holds only integers: no bool, float, string, null or container.

    In C where intake's extension was built (``_jsonscan.all_ints``: 0.3 ms for 262k ids); else
    :func:`_only_ints_bytes`."""
    return _all_ints(value) if _all_ints is not None else _only_ints_bytes(value)


def _only_ints_bytes(value: list[Any]) -> bool:
    """:func:`_only_ints` without the extension.

    Why not ``set(map(type, value))``: for a 262k-token prompt, the longest the scan lets through,
    that took 3.9 ms. orjson writes the list back in a third of it, and only digits, commas and minus
    signs may then be left between its brackets (a float is written with ``.`` or ``e``, NaN and
    infinities as ``null``, a bool as ``true``/``false``, a string with quotes, a container with
    brackets): 2.0 ms in all. An integer orjson cannot write (beyond 64 bits) answers False, and the
    caller's exact check decides."""
    try:
        return orjson.dumps(value).translate(None, _INT_CHARS) == b"[]"
    except orjson.JSONEncodeError:
        return False


def _generates(path: str, route: Route | None) -> bool:
    """Whether a request on this path generates tokens (reserves output): every inference route but
    embeddings; on other paths, those ending like the completions and responses routes."""
    if route is not None:
        return route != "embeddings"
    return path.split("?", 1)[0].rstrip("/").endswith(("/completions", "/responses"))


def _check_message(m: Any, where: str, chat: bool) -> None:
    """A chat message (``chat``) or a Responses input item: an object; a string role (optional for an
    input item); its content, if any, :func:`_check_content`. (``_jsonscan.bad_message`` is its C twin.)"""
    if not isinstance(m, dict):
        raise Invalid("invalid-body", f"'{where}' must be an object, not {_kind(m)}.", where)
    role = m.get("role")
    if (chat or role is not None) and not isinstance(role, str):
        raise Invalid("invalid-body", f"'{where}.role' must be a string.", f"{where}.role")
    if "content" in m:
        _check_content(m["content"], f"{where}.content")


def _check_content(content: Any, param: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise Invalid("invalid-body", f"'{param}' must be a string, null or a list of content parts, not "
                      f"{_kind(content)}.", param)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise Invalid("invalid-body", f"'{param}[{j}]' must be a content part: an object with a string 'type'.",
                          f"{param}[{j}]")


_SKIPPED_KEYS = frozenset({"type", "role"})
"""Keys whose values the walk does not count (a part's kind, a message's role)."""
_STR: frozenset[type] = frozenset({str})
_INT: frozenset[type] = frozenset({int})
_LIST: frozenset[type] = frozenset({list})
_NESTED: frozenset[type] = frozenset({dict, list})


_STRINGS_AND_BRACKETS = bytes(c for c in range(256) if c not in b'"[]{}')
"""Delete-table: what a nesting count need not see, once the escapes are gone."""
_ESCAPES_AND_BRACKETS = bytes(c for c in range(256) if c not in b'"[]{}\\/bfnrtu')
"""Delete-table keeping the backslash and every character a JSON escape may have after it, so that each
escape stays a pair (``\\n\\"`` must not become ``\\\\"``) until the escapes are taken out."""
_PARENS = bytes.maketrans(b"[]{}", b"()()")
"""Arrays and objects nest alike; one kind of bracket for both (valid JSON nests them properly)."""


def nesting_exceeds(body: bytes, limit: int) -> bool:
    """Whether the JSON document ``body`` (one orjson has parsed: valid JSON) nests deeper than ``limit``
    levels (the top-level container is level 1), from its bytes at C speed.

    Why not walk the parsed document: a Python visit of every container cost up to 7 ms for bodies
    the scan lets through (16k containers), and ``set(map(type, ...))`` over every list of scalars
    (4 ms for a 262k-token prompt). The caller skips it for a body with at most ``limit`` opening
    brackets, which cannot be deeper (most bodies). Here the strings are taken out exactly
    (escape pairs first, as ``intake.scan``'s exact path does; then the empty strings, then whatever
    lies between the remaining quote pairs), leaving only the brackets outside strings, and each
    ``replace`` of ``()`` removes every innermost pair: the depth is the number of such passes. Never
    an under-estimate: ``Core._rewrite``'s ``orjson.dumps`` raises beyond 255 levels. The cost is at
    most ``limit`` passes over the brackets, which ``intake.scan`` bounds on the inference routes.
    """
    if b"\\" in body:
        s = body.translate(None, _ESCAPES_AND_BRACKETS)
        # in valid JSON a backslash only starts an escape; pairs of backslashes first (left to right,
        # as JSON reads them), then the escaped quotes (other escapes go with the letters below)
        s = s.replace(b"\\\\", b"").replace(b'\\"', b"")
    else:
        s = body
    s = s.translate(None, _STRINGS_AND_BRACKETS)
    if b'"' in s:
        # quotes now alternate open, close; removing two adjacent ones keeps that, and leaves what is
        # between the rest where it was: a string with no bracket in it costs no split
        s = s.replace(b'""', b"")
        if b'"' in s:
            s = b"".join(s.split(b'"')[::2])
    s = s.translate(_PARENS)
    for _ in range(limit):
        if not s:
            return False
        s = s.replace(b"()", b"")
    return bool(s)


_NON_FINITE = (b"-Infinity", b"+Infinity", b"Infinity", b"-NaN", b"NaN")


def not_json(body: bytes, err: orjson.JSONDecodeError) -> Invalid:
    """Why orjson refused ``body``, in words a client can act on (400 ``invalid-json``).

    The cases named are those Python's ``json`` module (what FastAPI inside vLLM parses with) accepts
    and orjson does not: a UTF-8 byte order mark, ``NaN``/``Infinity``, numbers beyond a double
    (``1e999``), lone surrogates. Passed on unchecked, such a body would reach the node with none of
    kvgate's checks (``max_n``, ``max_output_tokens``, the usage it injects, the priority it sets)."""
    text = str(err)
    pos = max(0, int(err.pos))
    if body.startswith(b"\xef\xbb\xbf"):
        return _invalid_json("The request body starts with a UTF-8 byte order mark (BOM); send JSON "
                             "without one.")
    if "depth" in text or "recursion" in text:
        return too_deep()
    if "UTF-8" in text:
        return _invalid_json("The request body is not valid UTF-8 (it has invalid bytes or an encoded "
                             "lone surrogate).")
    if "surrogate" in text:
        return _invalid_json(f"The request body has a lone surrogate escape (\\uD800-\\uDFFF without its "
                             f"pair) near character {pos}.")
    near = body[max(0, pos - 1):pos + 9]
    for word in _NON_FINITE:
        if near.startswith(word) or near[1:].startswith(word):
            return _invalid_json(f"The request body has {word.decode()} near character {pos}: JSON numbers "
                                 f"must be finite (no NaN or Infinity).")
    if "infinity" in text or ("number" in text and "range" in text):
        return _invalid_json(f"The request body has a number out of range near character {pos} "
                             f"(larger than a double can hold).")
    detail = text.split(": line ", 1)[0]
    return _invalid_json(f"The request body is not valid JSON: {detail} (near character {pos}).")


def _invalid_json(message: str) -> Invalid:
    return Invalid("invalid-json", message)


def too_deep() -> Invalid:
    return Invalid("invalid-body", f"The request body is nested deeper than {MAX_JSON_DEPTH} levels.")


def _context(prompt: int, output: int, ctx: int, param: str) -> Invalid:
    if output:
        msg = (f"This request needs about {prompt + output} tokens ({prompt} of prompt, estimated, plus {output} of "
               f"output), more than the model's context of {ctx}. Lower '{param}' or shorten the prompt.")
    else:
        msg = f"The prompt is about {prompt} tokens (estimated), which does not fit the model's context of {ctx}."
    return Invalid("context-too-long", msg, param)


def _batch(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds: a list of strings or of token-id lists is a
    batch (one sequence each); a string or a list of token ids is one."""
    if type(prompt) is TokenIds:
        return prompt.prompts
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    if isinstance(value, str | int | float | bool) or value is None:
        text = orjson.dumps(value).decode() if not isinstance(value, float) or math.isfinite(value) else repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return _kind(value)
