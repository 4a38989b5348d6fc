"""Intake: what happens to an inference request before any decision needs its content.

    identity → gates that need no body → bounded parse → a validated request, or a 400 naming why

Each step costs less than the next and refuses what it can on its own, so a request is only read as
far as its answer needs:

1. **identity** — who is asking (``identity.py``): a caller without a known key costs a dict lookup,
   whatever it sends;
2. **cheap gates** — peeks at the tenant's quota that need no body (``Admission.precheck``): the body
   size, the concurrency cap, the request bucket. They refuse only where the full decision would
   certainly refuse for the same reason, and take nothing: a tenant already over its quota is
   answered its 429 without its body being parsed (before, a 3 MB hostile body cost 0.86 s of CPU
   even then);
3. **bounded parse** — :func:`scan`, one pass in C over the raw bytes (``_jsonscan.c``), refuses a
   body with more JSON elements, containers, strings, nesting, bytes outside strings or non-integer
   numbers than any request can need (400 ``body-too-complex``) before orjson builds a Python object
   per element; only then is it parsed and estimated (``estimate.py``, whose per-element loops run in
   C too). What the estimate visits is bounded by the same caps: each shape at its cap costs about
   5 ms at most, bodies just under two caps at once more (``kvgate bench intake``;
   docs/design/performance.md). A body orjson refuses is
   400 ``invalid-json`` naming why — never "not JSON, pass it on". Any 400 from this step is charged
   to the sender's request bucket by the bytes read (:func:`charge_for`).

Placement (the prefix chain, the node) comes after, in the core, for requests the quota gates let by.

Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from . import document as _document
from . import estimate as _estimate
from .bodycost import COST_MS, Counts, budget_ns, cost, refusal
from .config import Config, Limits, Tenant
from .document import IDS_MIN, Found, find_ids, searches
from .estimate import MAX_JSON_DEPTH, Estimate, Estimator, route_of, too_deep
from .identity import Identifier
from .reasons import UNKNOWN_KEY, Invalid, Rejection

MAX_CONTAINERS = 16_384
"""Most JSON objects and arrays a body may hold. A chat of 4,000 messages in content-part form holds
about 12,000; a request with many large tool schemas a few thousand. Each costs orjson a Python
object and the estimate's walks a visit."""
MAX_STRINGS = 65_536
"""Most JSON strings (keys and values) a body may hold: a batch of 2,048 embedding inputs or a long
chat stays far below; each costs the walk a visit."""
MIN_ELEMENTS = 65_536
"""The least element cap (values separated by commas, plus containers). A token-id prompt needs one
element per token: with ``limits.model_context_tokens`` set the cap is that context plus this much
(a longer prompt could never run), else :data:`DEFAULT_ELEMENTS`."""
DEFAULT_ELEMENTS = 262_144
"""The element cap without ``limits.model_context_tokens``: a 256k-token token-id prompt."""
OUTSIDE_BYTES_PER_ELEMENT = 9
"""Bytes outside strings (numbers, literals, structure; whitespace an eighth each) a body may hold, per
element of its cap: a token id of up to 8 digits and its comma. Past it, 400: 4 MiB of 20-digit numbers
(190k of them, under the element cap) cost orjson 7 ms. Whitespace counts an eighth: a pretty-printed
body (``json.dumps(indent=2)`` of a 262k-token prompt) is read, padding is not free. Counted by the C
pass only."""
MAX_FRACTIONS = 65_536
"""Most non-integer numbers (a ``.`` or an exponent) a body may hold: sampling parameters hold a few, a
``logit_bias`` of floats or tool schemas with float bounds tens of thousands; 166k floats cost orjson
8 ms. Counted by the C pass only."""
CHARGE_BYTES = 65_536
"""A refused body costs its sender one request per this many bytes (:func:`charge_for`): about what
an ordinary decision costs, read at the scan's speed."""

_KEEP = b'",[{\\'
_DROP = bytes(c for c in range(256) if c not in _KEEP)
_DROP_TO_STRUCTURE = bytes(c for c in range(256) if c not in b'",[{')
_ONE_BRACKET = bytes.maketrans(b"[", b"{")
"""Arrays and objects cost alike: counted as one character, one count."""
_FEW_QUOTES = 512
"""Up to this many quotes, the strings are set apart by ``find`` in place rather than by ``split``."""
_ESCAPABLE = b'",[{\\/bfnrtu'
"""Structure, the backslash and every character a JSON escape may have after it: a string's escapes
stay pairs once everything else is dropped, so an escaped quote is never taken for a delimiter."""
_DROP_BUT_ESCAPABLE = bytes(c for c in range(256) if c not in _ESCAPABLE)

_native: Callable[[bytes, int, int, int, int, int, int], tuple[int, ...]] | None
try:
    from ._jsonscan import scan as _native
except ImportError:  # installed without a C compiler (the extension is optional): scan_bytes, slower
    _native = None
SCAN_KIND = "c" if _native is not None else "python"
"""Which scan this install runs (the server logs it at start; ``python`` where the extension was not
built)."""
_OVER_ELEMENTS, _OVER_CONTAINERS, _OVER_STRINGS, _OVER_DEPTH, _OVER_OUTSIDE, _OVER_FRACTIONS = range(1, 7)
"""What ``_jsonscan.scan`` answers for the cap it stopped at."""


@dataclass(frozen=True, slots=True)
class Caps:
    """What a body may hold; beyond any of these it is 400 ``body-too-complex``."""

    elements: int
    containers: int = MAX_CONTAINERS
    strings: int = MAX_STRINGS
    outside: int | None = None
    """Bytes outside strings, whitespace an eighth each (None: :data:`OUTSIDE_BYTES_PER_ELEMENT` x
    ``elements``)."""
    fractions: int = MAX_FRACTIONS
    cost_ns: float = COST_MS * 1e6
    """What reading a body may cost, as ``bodycost.cost`` reckons it (:func:`~ext_proc.bodycost.budget_ns`)."""

    @property
    def outside_bytes(self) -> int:
        return self.outside if self.outside is not None else OUTSIDE_BYTES_PER_ELEMENT * self.elements

    @property
    def small(self) -> int:
        """Bodies up to this many bytes cannot exceed any cap but the nesting (a container or a string
        takes at least two bytes, a comma one and the container around it two, a non-integer number
        two): the pure-Python pass skips them, and the estimate checks their nesting itself; the C pass reads
        them for their depth only."""
        return min(self.elements, 2 * self.containers, 2 * self.strings, self.outside_bytes, 2 * self.fractions)


def caps_for(limits: Limits) -> Caps:
    """The caps for a config: the element cap follows the model's context when it is known and longer
    than the default's 256k (never lower: a batch of embedding inputs, 2,048 of 64 token ids, holds
    131k elements whatever the context — review: refused with an 8k context)."""
    ctx = limits.model_context_tokens
    return Caps(elements=max(DEFAULT_ELEMENTS, ctx + MIN_ELEMENTS) if ctx is not None else DEFAULT_ELEMENTS,
                cost_ns=budget_ns(limits.max_body_bytes))


def charge_for(size: int) -> int:
    """Requests of its bucket a body refused once read costs its sender: one per :data:`CHARGE_BYTES`
    read, at least one. Reading costs by the byte: a tenant at 600 requests/min sending 4 MB hostile
    bodies gets 9 readings a minute (each ~2-5 ms of CPU), then 429s that never reach the parser; a
    client whose small request was malformed loses one request, as if it had been sent."""
    return max(1, -(-size // CHARGE_BYTES))


class Costly(Invalid):
    """A cap only the C pass counts (the nesting, the bytes outside strings, the non-integer numbers) or the
    cost budget (``bodycost.py``) was passed: a 400 on an inference route; on another path, whose body may
    not be JSON at all, the body is not read (the size-only estimate) — neither refused for what a
    non-JSON body may hold, nor parsed at the cost the cap exists to avoid (review43 F1: 7-8 ms on a
    ``--route`` path without it)."""


@contextlib.contextmanager
def pure_python() -> Iterator[None]:
    """Intake and the estimate as an install without the C extension runs them, their Python loops, for
    as long as this lasts (``kvgate bench intake --pure-python``, the tests that hold C to Python)."""
    saved = [(m, name, getattr(m, name)) for m, name in ((sys.modules[__name__], "_native"),
                                                          (_estimate, "_walk_tokens"), (_estimate, "_bad_message"),
                                                          (_estimate, "_all_ints"), (_document, "_token_ids"))]
    try:
        for m, name, _ in saved:
            setattr(m, name, None)
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def scan(body: bytes, caps: Caps, route: str | None = None) -> int | None:
    """Refuse a body with more JSON elements, containers, strings, nesting or number bytes than ``caps``
    allow, or that would cost more to read than ``caps.cost_ns``, without parsing it (raises
    :class:`Invalid` ``body-too-complex``; :class:`Costly` for what only the C pass counts). Returns an
    upper bound on its nesting, for the estimate's nesting check (:func:`~ext_proc.estimate.nesting_exceeds`,
    skipped when no deeper nesting is possible); None for a body too small for the pure-Python pass to
    count. (``route``: as :func:`scan_and_find`.)

    One pass in C (``_jsonscan.c``) where the extension was built: it tells strings apart exactly,
    escapes included, stops at the first cap passed, and also refuses what is nested deeper than
    :data:`~ext_proc.estimate.MAX_JSON_DEPTH` (the estimate's own 400), the number-heavy bodies that
    cost orjson most (``caps.outside_bytes``, ``caps.fractions``), and a body whose counts together cost
    more than the budget (:func:`cost`); it returns the exact depth. Else :func:`scan_bytes`, which
    counts the first three caps only and returns the count of objects and arrays."""
    return scan_and_find(body, caps, route)[0]


def scan_and_find(body: bytes, caps: Caps, route: str | None) -> tuple[int | None, Found | None]:
    """:func:`scan`, and the token-id member of a body of ``route`` (``document.find_ids``, looked for only
    in a body within the caps): its ids are read in place, and the cost budget counts them so."""
    if _native is None:
        return (scan_bytes(body, caps) if len(body) > caps.small else None), None
    if len(body) <= caps.small and (brackets := body.count(b"{") + body.count(b"[")) <= MAX_JSON_DEPTH:
        return brackets, None  # (no deeper nesting possible: an ordinary request costs no C call)
    counts = _native(body, caps.elements, caps.containers, caps.strings, MAX_JSON_DEPTH, caps.outside_bytes,
                     caps.fractions)
    over = counts[4]
    if over == _OVER_STRINGS:
        raise _too_complex(f"more than {caps.strings} strings", caps.strings)
    if over == _OVER_CONTAINERS:
        raise _too_complex(f"more than {caps.containers} objects and arrays", caps.containers)
    if over == _OVER_ELEMENTS:
        raise _too_complex(f"more than {caps.elements} elements", caps.elements)
    if over == _OVER_DEPTH:
        deep = too_deep()
        raise Costly(deep.name, deep.message)
    if over == _OVER_OUTSIDE:
        raise Costly("body-too-complex", f"The request body has more than {caps.outside_bytes} bytes outside its "
                     f"strings (numbers, literals, whitespace an eighth each); this gateway reads at most "
                     f"{caps.outside_bytes}.")
    if over == _OVER_FRACTIONS:
        raise Costly("body-too-complex", f"The request body has more than {caps.fractions} non-integer numbers; "
                     f"this gateway reads at most {caps.fractions}.")
    if over:
        raise ValueError(f"_jsonscan.scan: unknown cap {over}")
    if len(body) <= caps.small:
        # (scanned all the same, for its depth: the estimate's own nesting pass took 64 passes over 32 KB
        # of brackets, 7.6 ms — attack43; a body this small cannot pass a cap or the budget)
        return counts[3], None
    c = Counts._make(counts)
    # (looked for only where ids could be most of the body)
    searched = c.numbers >= IDS_MIN and searches(body, route)
    ids = find_ids(body, route) if searched else None
    ns = cost(c, len(body), ids, searched, id_cap=DEFAULT_ELEMENTS if caps.elements > DEFAULT_ELEMENTS else None)
    if ns > caps.cost_ns:
        raise Costly("body-too-complex", refusal(c, len(body), ns, caps.cost_ns))
    return c.depth, ids


def scan_bytes(body: bytes, caps: Caps) -> int | None:
    """:func:`scan` in pure Python, for an install without the C extension: the same answers, the
    returned count an upper bound (exact outside strings when it took the exact pass); about 9 ms for
    4 MB of JSON-in-JSON text against the extension's 0.7.

    Counting structural characters at C speed (``bytes.translate`` drops all others, ``bytes.count``
    counts the rest) gives upper bounds: commas, brackets and quotes inside strings count too. When the
    bounds are within the caps — every ordinary request — that is all. Otherwise the characters inside
    strings are set apart exactly (escapes removed, then everything between quote pairs) and the caps
    apply to what is outside: a 4 MB prompt with a million commas in its text is fine, a million
    ``{}`` are not. Not a validator: a body that is not JSON passes here and orjson refuses it after.
    """
    if len(body) <= caps.small:
        return None
    s = body.translate(_ONE_BRACKET, _DROP)  # one pass: quotes, commas, brackets, backslashes; nothing else
    quotes = s.count(b'"')
    containers = s.count(b"{")
    elements = len(s) - quotes  # commas + containers (+ backslashes: still an upper bound)
    if quotes <= 2 * caps.strings and containers <= caps.containers and elements <= caps.elements:
        return containers
    backslashes = s.count(b"\\") if b"\\" in s else 0  # (memchr first: most bodies over a bound have none)
    elements -= backslashes
    if quotes - backslashes > 2 * caps.strings:
        # a quote inside a string is escaped, and a backslash escapes at most one: this many quotes are
        # delimiters whatever the exact pass would find — refused without it (a flood of strings with
        # escaped quotes in them cost that pass 18 ms; this refusal costs the scan's first pass)
        raise _too_complex(f"at least {(quotes - backslashes) // 2} strings", caps.strings)
    if quotes:
        # some of them may be inside strings: take those out (an escaped quote, or an escaped
        # backslash before a closing one, is the only way a quote is not a delimiter)
        if backslashes and b'\\"' in body:
            s = body.translate(None, _DROP_BUT_ESCAPABLE).replace(b"\\\\", b"").replace(b'\\"', b"")
            s = s.translate(_ONE_BRACKET, _DROP_TO_STRUCTURE)
            quotes = s.count(b'"')
        elif backslashes:
            s = s.translate(None, b"\\")  # (what follows counts quotes, commas and brackets only)
        if quotes > 2 * caps.strings:
            raise _too_complex(f"{quotes // 2} strings", caps.strings)
        if quotes <= _FEW_QUOTES:
            # a few strings (the hostile shapes: "model" and a flood of numbers or brackets): what is
            # inside them, counted in place, without copying the rest
            at = s.find(b'"')
            while at >= 0:
                end = s.find(b'"', at + 1)
                if end < 0:
                    break
                containers -= s.count(b"{", at + 1, end)
                elements -= end - at - 1
                at = s.find(b'"', end + 1)
        else:
            pieces = s.split(b'"')
            inside = pieces[1::2]
            if sum(map(len, inside)) < len(s) // 2:  # count whichever side is smaller, subtract it
                text = b"".join(inside)
                containers -= text.count(b"{")
                elements -= len(text)
            else:
                text = b"".join(pieces[::2])
                containers = text.count(b"{")
                elements = len(text)
    if containers > caps.containers:
        raise _too_complex(f"{containers} objects and arrays", caps.containers)
    if elements > caps.elements:
        raise _too_complex(f"about {elements} elements", caps.elements)
    return containers


def _too_complex(what: str, cap: int) -> Invalid:
    return Invalid("body-too-complex", f"The request body has {what}; this gateway reads at most {cap}.")


class Precheck(Protocol):
    """``Admission.precheck``: the cheap gates, and the charge for a body refused once read."""

    def __call__(self, tenant: Tenant, body_bytes: int, *, charge: int = 0) -> Rejection | None: ...


@dataclass(frozen=True, slots=True)
class Taken:
    """What intake made of a request: its tenant (None: no key, in shadow mode) and either its
    estimate or the rejection that answers it (decided before any quota is taken)."""

    tenant: Tenant | None
    estimate: Estimate | None
    rejection: Rejection | None = None
    gated: bool = False
    """Refused by the gates that need no body (a quota or size refusal the full decision would give too)."""


class Intake:
    """The steps above for one config; the core rebuilds it on a reload."""

    def __init__(self, config: Config, identifier: Identifier, estimator: Estimator,
                 precheck: Precheck) -> None:
        self._config = config
        self._identifier = identifier
        self._estimator = estimator
        self._precheck = precheck
        self.caps = caps_for(config.limits)

    def take(self, authorization: str | None, trusted: str | None, path: str, body: bytes, size: int,
             estimate: Estimate | None = None) -> Taken:
        """Identity, the gates that need no body, then (unless ``estimate`` is given: virtual time, or
        a request decided again after a borrow) the bounded parse."""
        tenant: Tenant | None = None
        read = False
        try:
            tenant = self._identifier.resolve(authorization, trusted).tenant
            if tenant is None and self._config.mode == "enforce":
                return Taken(None, None, UNKNOWN_KEY)
            if estimate is not None:
                return Taken(tenant, estimate)
            if tenant is not None:
                refused = self._precheck(tenant, size)
                if refused is not None:
                    return Taken(tenant, None, refused, gated=True)
            read = True
            default_max = (tenant.default_max_tokens if tenant else None) or \
                self._config.estimation.default_max_tokens
            route = route_of(path)
            try:  # (any path: a hand-written route may lead here too)
                depth, ids = scan_and_find(body, self.caps, route)
            except Costly:
                if route is not None:
                    raise
                return Taken(tenant, self._estimator.unparsed(body, path=path, default_max_tokens=default_max))
            return Taken(tenant, self._estimator.estimate(body, path=path, default_max_tokens=default_max,
                                                          depth_bound=depth, ids=ids))
        except Invalid as e:
            if read and tenant is not None:
                self._precheck(tenant, size, charge=charge_for(size))  # the reading is charged to the sender
            return Taken(tenant, None, e.rejection())
