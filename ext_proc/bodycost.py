"""What reading a request body costs kvgate, from the counts of intake's C pass — the cost budget.

Each of intake's caps (elements, objects and arrays, strings, bytes outside strings, non-integer
numbers) bounds one kind of element a body may hold; nothing bounded their sum, and a body just under
two caps at once cost 7.5-12.7 ms of CPU where one at a single cap cost 5. The C pass counts what the
parse and the estimate pay for (:class:`Counts`); :func:`cost` weighs the counts by what each costs
(:class:`Weights`, nanoseconds) and intake refuses a body past :func:`budget_ns` (400
``body-too-complex``, before orjson builds anything).

The figure is a model, not a measurement: deterministic (the same body gets the same answer on every
replica, however busy), calibrated on one machine kind, and meant to over-count rather than under-count.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

COST_MS = 4.8
"""The budget per :data:`BUDGET_BYTES` of ``limits.max_body_bytes`` (never less): under issue 28's 5 ms
with the model's error to spare. It follows the body limit because an operator who accepts larger
bodies accepts reading them — a 16 MiB limit reads a 16 MiB prompt of text — while a body of the
default size stays within 5 ms."""
BUDGET_BYTES = 4 * 1024 * 1024
"""The body size :data:`COST_MS` is for (the default ``limits.max_body_bytes``)."""


class Counts(NamedTuple):
    """What ``_jsonscan.scan`` returns, in its order: outside strings, objects and arrays, elements (commas
    and containers), strings, the nesting depth, the cap passed (0: none), keys (a string before a colon),
    backslash escapes in strings (``\\u`` ones also counted apart), non-integer numbers, numbers (a
    digit or '-' that starts one, not a fraction's or an exponent's digits), arrays, and what costs orjson
    more in non-ASCII text (attack43)."""

    containers: int
    elements: int
    strings: int
    depth: int
    over: int
    keys: int
    escapes: int
    unicode_escapes: int
    fractions: int
    numbers: int
    arrays: int
    high_escapes: int
    """Escapes in strings that also hold non-ASCII bytes (orjson decodes such a string ~3x slower)."""
    high_key_bytes: int
    """Bytes of keys that hold non-ASCII bytes."""
    high_strings: int
    """Strings (keys and values) that hold non-ASCII bytes."""
    high_escaped_bytes: int
    """Bytes of strings that hold both non-ASCII bytes and escapes."""


@dataclass(frozen=True, slots=True)
class Weights:
    """Nanoseconds of kvgate CPU one of each costs — the scan, the search for token ids, the parse, the
    estimate's walks and the freeing of the document — measured through the production ``Core`` (``min``
    of 5 decisions, process CPU time) on the 2-core CI machine kind, over ~50 body shapes at three sizes
    each. Each weight is the most its shapes needed — lists of numbers are dearer than objects, a key is
    counted as a distinct one (7x a repeated key's cost) — so a mix is over-counted (by 5-30% at the
    budget) rather than under-counted (``kvgate bench intake``: the "at the budget" rows)."""

    byte: float = 0.62
    """Every byte: the passes over it, orjson's validation, a string's copy (4 MiB of CJK text ~2.5 ms)."""
    element: float = 5.7
    number: float = 14.0
    """A number outside a token-id prompt: a Python int or float each."""
    fraction: float = 10.0
    """More for a non-integer number: its parse."""
    array: float = 120.0
    """A list: the dearest container (a list of numbers is built item by item)."""
    object: float = 55.0
    string: float = 30.0
    """A string value (keys are counted as keys)."""
    key: float = 70.0
    """A key: its string, hash and slot, counted as a distinct key."""
    escape: float = 1.7
    unicode_escape: float = 3.8
    """More for a ``\\u`` escape than another: its decoding (Python's ``json.dumps`` writes every non-ASCII
    character so; a 2,000-message chat so written, 3.6 MB, cost 5.2 ms at 3.3 — attack44)."""
    high_escape: float = 3.5
    """More for an escape in a string with non-ASCII bytes: orjson's slow path (``"é\\n"`` repeated over
    4 MiB cost 6.1 ms when such an escape was priced as any other — attack43; ``"😀\\n"`` 5.1-5.4 ms at 2.2
    — attack44; mixed 2-, 3- and 4-byte characters with escapes 1.15-1.19x the model at 3.0 — attack45)."""
    high_escaped_byte: float = 0.25
    """More for a byte of a string with both non-ASCII bytes and escapes: orjson copies it piece by piece
    into a wider str (``"é漢😀\\n"`` over 4 MiB: 1.26 ns a byte, 5.3 ms at a model of 4.8 without it —
    attack45)."""
    high_string: float = 15.0
    """More for a string with non-ASCII bytes: decoded to a wider Python str (65k short ``"😀"`` strings
    cost 1.33x the model without it — attack45)."""
    high_key_byte: float = 0.5
    """More for a byte of a key with non-ASCII bytes (distinct emoji keys, 3.5 MB: 5.6-6.0 ms — attack43)."""
    token_id: float = 1.8
    """An id of a token-id prompt read in place (``document.py``): its two C passes."""
    searched_byte: float = 0.55
    """A byte the search for a token-id prompt stepped over (``document.find_ids``): one more pass, a byte
    at a time through escape-dense text (0.25 let 4,096 ids beside a 3.1 MB string of ``"😀\\n"`` cost
    7.6-7.9 ms at a model of 4.8 — attack44)."""
    copied_byte: float = 0.3
    """A byte outside the ids, when they are kept raw: the body is copied around them, once."""


WEIGHTS = Weights()


def budget_ns(max_body_bytes: int) -> float:
    """The cost budget, in nanoseconds, for a config's body limit."""
    return COST_MS * 1e6 * max(1.0, max_body_bytes / BUDGET_BYTES)


def cost(c: Counts, size: int, ids: tuple[int, int, int, int, int] | None = None, searched: bool = False,
         id_cap: int | None = None, w: Weights = WEIGHTS) -> float:
    """What reading a body of ``size`` bytes costs, in nanoseconds: its counts, and the token-id member
    ``document.find_ids`` found (``(start, end, lists, total, longest)``: its ids read in place, not
    parsed) after a search of the body (``searched``). ``id_cap``: the most of that member's ids charged —
    the default element cap, when ``limits.model_context_tokens`` raised the cap: the context admits the
    ids past it (their bytes are charged)."""
    id_count, id_lists, id_bytes = (ids[3], max(ids[2], 0), ids[1] - ids[0]) if ids is not None else (0, 0, 0)
    return (w.byte * size + w.element * (c.elements - id_count - id_lists)
            + w.number * (c.numbers - id_count) + w.fraction * c.fractions
            + w.array * (c.arrays - id_lists) + w.object * (c.containers - c.arrays)
            + w.string * (c.strings - c.keys) + w.key * c.keys
            + w.escape * (c.escapes - c.unicode_escapes) + w.unicode_escape * c.unicode_escapes
            + w.high_escape * c.high_escapes + w.high_key_byte * c.high_key_bytes
            + w.high_string * c.high_strings + w.high_escaped_byte * c.high_escaped_bytes
            + w.token_id * (id_count if id_cap is None else min(id_count, id_cap))
            + (w.searched_byte * (size - id_bytes) if searched else 0.0)
            + (w.copied_byte * (size - id_bytes) if ids is not None else 0.0))


def refusal(c: Counts, size: int, ns: float, budget: float) -> str:
    """The 400's message: what the body holds, and what a client can change."""
    advice = ("Send the text as UTF-8 rather than \\u escapes (json.dumps(..., ensure_ascii=False)), or less of it."
              if c.unicode_escapes * 6 > size // 4 else "Send fewer elements, or the prompt as text.")
    return (f"The request body holds too much to read at once ({c.containers} objects and arrays, {c.strings} "
            f"strings of which {c.keys} keys, {c.numbers} numbers, {c.escapes} escapes in {size} bytes: about "
            f"{ns / 1e6:.1f} ms of work as this gateway reckons it); it reads up to {budget / 1e6:.1f} ms a request "
            f"(limits.max_body_bytes raises it). {advice}")
