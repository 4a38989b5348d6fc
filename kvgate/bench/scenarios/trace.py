"""The trace format: one request a line (JSONL), what ``kvgate bench scenarios --trace`` replays and
what ``kvgate bench trace --scenario NAME`` writes.

A line is a JSON object::

    {"t": 12.5, "tenant": "rag", "prompt_tokens": 3200, "output_tokens": 250, "stream": false}

* ``t`` — arrival, seconds from the start of the trace (>= 0; lines need not be sorted);
* ``tenant`` — the tenant's name (as in the config; a name the config lacks is an unknown API key);
* ``prompt_tokens`` — tokens of the prompt (>= 1);
* ``output_tokens`` — tokens the model will generate (>= 1);
* ``stream`` — optional, default false;
* ``max_tokens`` — optional, what the client asks for (>= output_tokens; default output_tokens):
  what admission reserves before the real usage is known;
* ``segments`` — optional, what the prompt starts with, for prefix caching: ``[[id, tokens], ...]``,
  a list of shared pieces (a system prompt, a RAG document, a chat's history so far) by id and token
  length (ids are strings; the same id is the same tokens wherever it appears); their tokens add up to
  at most ``prompt_tokens``, the rest is the request's own. Without it a prompt shares nothing;
* ``session`` — optional, the conversation a request belongs to (a string; informational);
* ``model`` — optional, the body's ``model``: with a kvgate config of several ``pools`` it picks the pool
  (and so the nodes) the request goes to; without pools it is not needed (one pool serves every model).

Blank lines and lines starting with ``#`` are skipped. Every bad line is reported with its number.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_ERRORS = 20


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float
    tenant: str
    prompt_tokens: int
    output_tokens: int
    stream: bool = False
    max_tokens: int | None = None
    segments: tuple[tuple[str, int], ...] | None = None
    """Shared pieces the prompt starts with (id, tokens); the rest of the prompt is its own."""
    session: str | None = None
    model: str | None = None
    """The body's ``model`` (kvgate routes it to the pool that serves it); None: the request names none."""

    @property
    def reserved_output(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.output_tokens

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"t": round(self.t, 6), "tenant": self.tenant, "prompt_tokens": self.prompt_tokens,
                               "output_tokens": self.output_tokens, "stream": self.stream}
        if self.max_tokens is not None:
            doc["max_tokens"] = self.max_tokens
        if self.segments is not None:
            doc["segments"] = [[i, n] for i, n in self.segments]
        if self.session is not None:
            doc["session"] = self.session
        if self.model is not None:
            doc["model"] = self.model
        return doc


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message lists the bad lines by number."""


def _int(doc: dict[str, Any], key: str, least: int) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key}: must be a whole number, got {v!r}")
    if v < least:
        raise ValueError(f"{key}: must be at least {least}, got {v}")
    return v


def parse_line(text: str) -> TraceRequest:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg})") from None
    if not isinstance(doc, dict):
        raise ValueError("must be a JSON object")
    unknown = set(doc) - {"t", "tenant", "prompt_tokens", "output_tokens", "stream", "max_tokens", "segments",
                          "session", "model"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    t = doc.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0:
        raise ValueError(f"t: must be a number of seconds >= 0, got {t!r}")
    tenant = doc.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant: must be a non-empty string, got {tenant!r}")
    prompt = _int(doc, "prompt_tokens", 1)
    output = _int(doc, "output_tokens", 1)
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"stream: must be true or false, got {stream!r}")
    max_tokens = None
    if "max_tokens" in doc:
        max_tokens = _int(doc, "max_tokens", output)
    segments = _segments(doc.get("segments"), prompt) if "segments" in doc else None
    session = doc.get("session")
    if session is not None and (not isinstance(session, str) or not session):
        raise ValueError(f"session: must be a non-empty string, got {session!r}")
    model = doc.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"model: must be a non-empty string, got {model!r}")
    return TraceRequest(float(t), tenant, prompt, output, stream, max_tokens, segments, session, model)


def _segments(v: Any, prompt: int) -> tuple[tuple[str, int], ...]:
    if not isinstance(v, list):
        raise ValueError(f"segments: must be a list of [id, tokens], got {v!r}")
    out: list[tuple[str, int]] = []
    for k, seg in enumerate(v):
        if (not isinstance(seg, list) or len(seg) != 2 or not isinstance(seg[0], str) or not seg[0]
                or isinstance(seg[1], bool) or not isinstance(seg[1], int) or seg[1] < 1):
            raise ValueError(f"segments[{k}]: must be [id, tokens] with a non-empty string id and tokens >= 1, "
                             f"got {seg!r}")
        out.append((seg[0], seg[1]))
    if sum(n for _, n in out) > prompt:
        raise ValueError(f"segments: {sum(n for _, n in out)} tokens, more than prompt_tokens ({prompt})")
    return tuple(out)


def read_trace(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"{p}: cannot read trace: {e.strerror}") from None
    out: list[TraceRequest] = []
    errors: list[str] = []
    for n, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            out.append(parse_line(s))
        except ValueError as e:
            errors.append(f"  line {n}: {e}")
    if errors:
        more = f"\n  ... and {len(errors) - MAX_ERRORS} more" if len(errors) > MAX_ERRORS else ""
        raise TraceError(f"{p}: {len(errors)} bad line(s)\n" + "\n".join(errors[:MAX_ERRORS]) + more)
    if not out:
        raise TraceError(f"{p}: no requests in the trace")
    out.sort(key=lambda r: r.t)
    return out


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    n = 0
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n
