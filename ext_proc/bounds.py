"""Bounded containers for what clients and churn can make kvgate remember.

Everything kvgate keeps per request input (a model name, a request id) or per node that comes and goes
must have a bound that holds whatever the traffic: a client that sends 200 distinct one-megabyte model
names, or disconnects 10,000 times a second, must not be able to grow the process until its memory
limit kills it (and every replica with it). Each structure here is bounded by count (and, where the
keys come from clients, by bytes) and says what happens at the bound; the bounds themselves, their
defaults and their consequences are listed in docs/operator/configuration.md ("Memory bounds").

Pure: no clock of its own (times are passed in), no I/O.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

SHOWN_CHARS = 64
"""At most this many characters of a client-supplied name are echoed back in a refusal's message."""


def shown(name: str, limit: int = SHOWN_CHARS) -> str:
    """A client-supplied name as a refusal's message may quote it: escaped (``repr``: no control
    characters, no quotes to break out of) and cut to ``limit`` characters, so that a 4 MB name is not
    sent back (and logged) whole."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}... ({len(name)} characters)"


def key_bytes(key: object) -> int:
    """The memory a cache key holds (a string, or a tuple of strings): what a byte bound counts."""
    if isinstance(key, tuple):
        return sys.getsizeof(key) + sum(sys.getsizeof(k) for k in key)
    return sys.getsizeof(key)


class LruCache(Generic[K, V]):
    """A least-recently-used cache bounded both by entries and by the bytes of its keys.

    A count alone is no bound when the keys come from clients: 4,096 entries of a 4 MB model name are
    16 GB. Beyond either bound the least recently used entries go; a key larger than the whole byte
    budget is not cached at all (it is looked up again next time: a cache only saves work)."""

    __slots__ = ("_bytes", "_data", "max_bytes", "max_entries")

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0

    def get(self, key: K) -> V | None:
        hit = self._data.get(key)
        if hit is None:
            return None
        self._data.move_to_end(key)
        return hit[0]

    def put(self, key: K, value: V) -> None:
        size = key_bytes(key)
        if size > self.max_bytes:
            return
        old = self._data.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._data[key] = (value, size)
        self._bytes += size
        while len(self._data) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, gone) = self._data.popitem(last=False)
            self._bytes -= gone

    @property
    def nbytes(self) -> int:
        """The bytes of the keys held (what ``max_bytes`` bounds)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)


class Expiring(Generic[K]):
    """Keys remembered for ``ttl`` seconds, at most ``max_entries`` of them (the oldest go first).

    Insertion order is time order (times come from one monotonic clock), so expired keys are always
    at the front: each :meth:`add` drops the expired ones it finds there (amortised: every key is
    dropped once), and nothing ever scans the whole set."""

    __slots__ = ("_at", "max_entries", "ttl")

    def __init__(self, ttl: float, max_entries: int) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._at: OrderedDict[K, float] = OrderedDict()
        """(An OrderedDict: dropping from the front of a plain dict walks past every slot deleted
        before, so forgetting 50,000 keys one by one took ~0.4-0.9 s; ``popitem(last=False)`` is O(1).)"""

    def add(self, key: K, now: float) -> None:
        at = self._at
        at.pop(key, None)  # (added again: it moves to the back, its time is now)
        at[key] = now
        self.sweep(now)
        while len(at) > self.max_entries:
            at.popitem(last=False)

    def sweep(self, now: float) -> None:
        """Drop the keys older than ``ttl``."""
        at = self._at
        ttl = self.ttl
        while at:
            # (an age, as "older than ttl" reads: ``at > now - ttl`` rounds the other way at the edge)
            if now - at[next(iter(at))] < ttl:
                break
            at.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def __len__(self) -> int:
        return len(self._at)

    def __bool__(self) -> bool:
        return bool(self._at)
