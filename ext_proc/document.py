"""A request body as a document: parsed once, cheaply, and written back as it came.

Two costs of parsing a large body have nothing to do with what kvgate reads in it:

* **a Python int per token id** — a completions ``prompt`` or an embeddings ``input`` of token ids
  (a list of ints, or a list of lists of them) is most of its body, and orjson spends ~4.5 ms building
  262k ints of a 262k-id prompt (~17 ns each, 90% of the decision); the estimate needs their count
  only, prefix affinity the first few thousand. Such a member is read by the C pass
  (``_jsonscan.token_ids``: strict JSON integers, counted in place) and kept as its raw bytes,
  :class:`TokenIds`; orjson parses the rest. 262k ids: 4.7 ms → ~1 ms.
* **the cyclic garbage collector** — a parsed document holds no reference cycle, yet each of its lists
  and dicts counts towards the collector's next pass: 16k lists of ids set off some 25 passes in the
  middle of the parse, 1.4 ms of 7. Large bodies are parsed with it paused (:func:`_parse`).

:func:`dumps` writes a document back, a :class:`TokenIds` as the bytes the client sent.
"""

from __future__ import annotations

import enum
import gc
from dataclasses import dataclass
from typing import Any

import orjson

try:
    from ._jsonscan import token_ids as _token_ids
except ImportError:  # installed without a C compiler: every body parsed whole
    _token_ids = None  # type: ignore[assignment]

PAUSE_BYTES = 65_536
"""Bodies from this size up are parsed with the cyclic garbage collector paused, and a token-id prompt
in them kept raw; smaller ones cost too little for either to matter."""

IDS_MIN = 4_096
"""Fewer ids than this are parsed as any list is: kept raw, they would save less than the body's two
copies cost (a 3-id prompt in a 4 MiB body: 1.60 ms against 1.44 — review45). Intake looks for ids only
in a body with this many numbers."""

IDS_KEYS: dict[str, str] = {"completions": "prompt", "embeddings": "input"}
"""The member that may hold token ids, by route (the only routes whose prompt may be token ids)."""


@dataclass(frozen=True, slots=True)
class TokenIds:
    """A ``prompt`` / ``input`` of token ids, unparsed: its JSON text and what the estimate reads."""

    raw: bytes
    """The value's JSON text as the client sent it (what :func:`dumps` writes back)."""
    lists: int
    """How many token-id lists it holds: -1 for one flat list of ids (one prompt)."""
    total: int
    """How many ids in all."""
    longest: int
    """The most ids in one list (a flat list: ``total``)."""

    @property
    def prompts(self) -> int:
        """How many prompts (sequences) it is: its lists, or one."""
        return self.lists if self.lists > 0 else 1

    def head(self, count: int) -> list[int]:
        """Its first ``count`` ids (a flat list; [] for a list of lists), for prefix affinity."""
        if self.lists >= 0 or count <= 0:
            return []
        if count >= self.total:
            return list(orjson.loads(self.raw))
        size = (count + 1) * 20  # an id and its comma: at most 20 bytes, whitespace aside
        while True:
            piece = self.raw[:size]
            cut = piece.rfind(b",")
            ids = orjson.loads(piece[:cut] + b"]") if cut > 0 else []
            if len(ids) >= count or size >= len(self.raw):  # (wide whitespace: read further — review45)
                return list(ids[:count])
            size *= 2


Found = tuple[int, int, int, int, int]
"""Where a token-id member is and what it holds: (start, end, lists, total, longest) (``_jsonscan.token_ids``)."""


def searches(body: bytes, route: str | None) -> bool:
    """Whether :func:`find_ids` makes its pass over this body (a large one, of a route whose prompt may be
    token ids, with the extension built): intake's cost budget charges the pass."""
    return route in IDS_KEYS and _token_ids is not None and len(body) >= PAUSE_BYTES


def find_ids(body: bytes, route: str | None) -> Found | None:
    """The large token-id ``prompt`` / ``input`` of a body of ``route``, if it has one (a pass in C over
    the top-level object, stopping at the member); None for anything else."""
    if route is None or _token_ids is None or not searches(body, route):
        return None
    found = _token_ids(body, _KEY_BYTES[IDS_KEYS[route]])
    return found if found is not None and found[3] >= IDS_MIN else None


_KEY_BYTES = {k: k.encode() for k in IDS_KEYS.values()}


class Look(enum.Enum):
    """The one value of ``LOOK``."""

    LOOK = "look"


LOOK = Look.LOOK
"""``loads``'s default: look for a token-id member itself."""


def loads(body: bytes, route: str | None = None, found: Found | Look | None = LOOK) -> Any:
    """``orjson.loads``, keeping a large token-id ``prompt`` / ``input`` of ``route`` raw (a
    :class:`TokenIds`); ``found`` is :func:`find_ids`'s answer when the caller already has it. Raises
    ``orjson.JSONDecodeError`` as orjson would on the whole body (its position in the body as sent)."""
    if found is LOOK:
        found = find_ids(body, route)
    if found is None or route is None:
        return _parse(body)
    key = IDS_KEYS[route]
    start, end, lists, total, longest = found
    try:
        doc = _parse(body[:start] + b"null" + body[end:])
    except orjson.JSONDecodeError as e:  # (elsewhere in the body: named where it is in the body sent)
        # orjson counts characters, not bytes: the ids (ASCII) start this many characters in (attack43)
        at = len(body[:start].decode("utf-8", "replace"))
        pos = e.pos if e.pos < at + 4 else e.pos + (end - start) - 4
        raise orjson.JSONDecodeError(e.msg, "", pos) from None
    doc[key] = TokenIds(body[start:end], lists, total, longest)  # (the C pass found one object, key once)
    return doc


def dumps(doc: Any) -> bytes:
    """``orjson.dumps``, a :class:`TokenIds` written as the bytes it came as."""
    # (passed through: orjson would write a dataclass field by field)
    return orjson.dumps(doc, default=_raw, option=orjson.OPT_PASSTHROUGH_DATACLASS)


def _raw(value: Any) -> orjson.Fragment:
    if type(value) is TokenIds:
        return orjson.Fragment(value.raw)
    raise TypeError(f"not JSON: {type(value).__name__}")


def _parse(body: bytes) -> Any:
    if len(body) < PAUSE_BYTES or not gc.isenabled():
        return orjson.loads(body)
    try:  # (orjson holds the GIL throughout: no other thread allocates meanwhile)
        gc.disable()
        return orjson.loads(body)
    finally:
        gc.enable()
