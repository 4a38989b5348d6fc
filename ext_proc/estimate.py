"""How many tokens a request will cost, estimated before it runs.

No tokenizer is downloaded: by default a token is ``chars_per_token`` characters of text (4.0, the
usual figure for English with GPT/Llama-style BPE vocabularies; code and CJK text run denser, so
set it lower for such traffic). A local ``tokenizer.json`` can be configured for exact counts.
The estimate only has to be good enough to *reserve* budget: the real usage reported by the
server replaces it when the response ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .config import Estimation

IMAGE_PART_TOKENS = 768
"""Reservation for one image/audio content part; their payloads (base64, URLs) say nothing of tokens."""

_OPAQUE_PARTS = frozenset({"image_url", "input_audio", "input_image", "file"})


@dataclass(frozen=True, slots=True)
class Estimate:
    prompt_tokens: int
    output_tokens: int
    """Output reserved for this request: max_tokens (or the default) times the number of choices."""
    parsed: bool
    """False when the body was not a JSON object: then the estimate comes from its size alone."""
    stream: bool = False
    include_usage: bool = False
    """True when the client itself asked for the final usage chunk."""
    document: dict[str, Any] | None = None

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.output_tokens


class Estimator:
    def __init__(self, cfg: Estimation) -> None:
        self._ratio = cfg.chars_per_token
        self._per_message = cfg.per_message_tokens
        self._encode: Callable[[str], int] | None = None
        if cfg.tokenizer_json is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(cfg.tokenizer_json))
            self._encode = lambda s: len(tok.encode(s, add_special_tokens=False).ids)

    def text_tokens(self, chars: int, text: str | None = None) -> int:
        if self._encode is not None and text is not None:
            return self._encode(text)
        return math.ceil(chars / self._ratio)

    def estimate(self, body: bytes, *, generates: bool, default_max_tokens: int) -> Estimate:
        """Estimate a request from its raw body.

        ``generates`` is True for endpoints that produce output tokens (``.../completions``); others
        (embeddings) reserve none.
        """
        try:
            doc = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            out = default_max_tokens if generates else 0
            return Estimate(self.text_tokens(len(body)), out, parsed=False)
        prompt = self._prompt_tokens(doc)
        output = 0
        if generates:
            choices = _int_in(doc.get("n"), 1, 128) or 1
            best_of = _int_in(doc.get("best_of"), 1, 128) or 1
            requested = _int_in(doc.get("max_completion_tokens"), 0, 1 << 24)
            if requested is None:
                requested = _int_in(doc.get("max_tokens"), 0, 1 << 24)
            output = (default_max_tokens if requested is None else requested) * max(choices, best_of)
        stream = doc.get("stream") is True
        opts = doc.get("stream_options")
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        return Estimate(prompt, output, True, stream, include_usage, doc)

    def _prompt_tokens(self, doc: dict[str, Any]) -> int:
        messages = doc.get("messages")
        if isinstance(messages, list):
            total = 0
            for m in messages:
                total += self._per_message + self._value_tokens(m)
            tools = doc.get("tools")
            if tools is not None:
                total += self._value_tokens(tools)
            return total
        for field in ("prompt", "input"):
            value = doc.get(field)
            if value is not None:
                return self._prompt_value(value)
        return 0

    def _prompt_value(self, value: Any) -> int:
        """``prompt``/``input``: a string, token ids, or a batch of either."""
        if isinstance(value, str):
            return self.text_tokens(len(value), value)
        if isinstance(value, list):
            if value and all(isinstance(x, int) for x in value):
                return len(value)
            return sum(self._prompt_value(x) for x in value)
        return 0

    def _value_tokens(self, value: Any) -> int:
        """Tokens of every string inside a message (content, names, tool calls); media parts count flat."""
        if isinstance(value, str):
            return self.text_tokens(len(value), value)
        if isinstance(value, list):
            return sum(self._value_tokens(x) for x in value)
        if isinstance(value, dict):
            total = 0
            for k, v in value.items():
                if k in _OPAQUE_PARTS:
                    total += IMAGE_PART_TOKENS
                elif k != "type" and k != "role":
                    total += self._value_tokens(v)
            return total
        return 0


def _int_in(value: Any, lo: int, hi: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if lo <= value <= hi else None
