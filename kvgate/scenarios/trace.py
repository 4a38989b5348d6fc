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
  what admission reserves before the real usage is known.

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

    @property
    def reserved_output(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.output_tokens

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"t": round(self.t, 6), "tenant": self.tenant, "prompt_tokens": self.prompt_tokens,
                               "output_tokens": self.output_tokens, "stream": self.stream}
        if self.max_tokens is not None:
            doc["max_tokens"] = self.max_tokens
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
    unknown = set(doc) - {"t", "tenant", "prompt_tokens", "output_tokens", "stream", "max_tokens"}
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
    return TraceRequest(float(t), tenant, prompt, output, stream, max_tokens)


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
