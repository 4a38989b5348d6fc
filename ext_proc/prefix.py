"""Which node may already hold a prompt's prefix in vLLM's prefix cache: kvgate's approximate index.

vLLM reuses the KV blocks of a prompt prefix it has computed (automatic prefix caching): a request
sent to the node that holds its prefix skips that prefill. kvgate cannot see vLLM's cache and has no
tokenizer, so it keeps its own picture of it, from what it sent where:

* a prompt is cut into blocks of ``nodes.prefix.block_chars`` characters of its text (512: about 128
  tokens at 4 characters a token), hashed in a chain from the start — a block's key covers everything
  before it, as vLLM's block hashes do — up to ``max_blocks_per_request`` blocks; in virtual time, where
  there is no text, blocks of ``block_chars`` / 4 tokens over the trace's prefix segments
  (:func:`segment_chain`);
* :class:`PrefixIndex` remembers, per node, the blocks sent there (least recently used forgotten first
  beyond ``max_blocks_per_node``, and any not sent again for ``ttl_seconds``), and at most ``max_blocks``
  in all (the least recently sent block of any node goes first): the index costs ~350 B a block, and
  10,000 a node at 1,000 nodes would be 3.4 GB. Expired blocks are swept as new ones come, a bounded
  number per record, oldest first (each node's blocks are in time order: a heap of each node's oldest
  finds them without scanning);
* node choice (``picker.py``) asks it how many leading blocks each candidate holds, and counts that
  much less prefill in the node's predicted time to first token and that much less in its KV
  projection. Affinity is a prediction, not a rule: a busy node holding the prefix loses to an idle
  one as soon as its queue costs more than the prefill it would save.

Approximations, documented: text blocks are not token blocks (the same text gives the same chain, which
is all the index needs); vLLM evicts by its own LRU under KV pressure, which the index only bounds; the
hashes are Python's (randomised per process), so each replica keeps its own index.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

from .document import TokenIds

SEGMENT_BLOCK_TOKENS = 128
"""Tokens per index block in virtual time (segments), by default: ``block_chars`` / 4."""
SWEEP_EXTRA = 16
"""Each record sweeps up to twice its chain's length plus this many expired blocks: more than it adds,
so a backlog of expired blocks (after a quiet spell) drains under traffic without one request paying
for all of it."""


def text_of(doc: dict[str, Any] | None, limit: int = 1 << 62) -> str:
    """The prompt text of a request body, as one string (chat messages: role and content in order;
    content parts that are not text by their URL), at most about ``limit`` characters."""
    if doc is None:
        return ""
    messages = doc.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for m in messages:
            if not isinstance(m, dict):
                continue
            parts.append(f"\x00{m.get('role', '')}\x01")
            c = m.get("content")
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                for p in c:
                    if isinstance(p, dict):
                        t = p.get("text")
                        parts.append(t if isinstance(t, str) else f"\x02{p.get('type')}:{_url(p)}\x03")
            size += sum(len(x) for x in parts[-2:])
            if size > limit:
                break
        return "".join(parts)
    for key in ("prompt", "input"):
        p = doc.get(key)
        if isinstance(p, str):
            return p
        if type(p) is TokenIds and p.lists < 0 and p.total:  # (kept raw: ``document.py``; as a list of ints)
            return ",".join(map(str, p.head(limit // 2 + 1)))
        if isinstance(p, list) and p:
            # a token-id prompt: its first ``limit // 2 + 1`` ids give at least ``limit`` characters (an
            # id and its comma), all the chain reads (joining a 200k-id prompt whole cost more than
            # the rest of its decision)
            head = p[:limit // 2 + 1]
            if all(isinstance(x, int) for x in head):
                return ",".join(map(str, head))
    return ""


def text_chain(text: str, block_chars: int, max_blocks: int, seed: int = 0) -> tuple[int, ...]:
    """Chained hashes of the full ``block_chars`` blocks at the start of ``text``. ``seed``: what else
    keys vLLM's cache (the model or LoRA adapter, a ``cache_salt``): the same text under another seed
    shares nothing."""
    out: list[int] = []
    h = seed
    end = min(len(text), block_chars * max_blocks) - block_chars
    for i in range(0, end + 1, block_chars):
        h = hash((h, text[i:i + block_chars]))
        out.append(h)
    return tuple(out)


def segment_chain(segments: Sequence[tuple[str, int]], max_blocks: int,
                  block: int = SEGMENT_BLOCK_TOKENS) -> tuple[int, ...]:
    """Chained hashes of the full ``block``-token blocks of a prompt that starts with ``segments``
    (id, tokens): what two prompts sharing their leading segments share."""
    out: list[int] = []
    h = 0
    pieces: list[tuple[str, int, int]] = []
    filled = 0
    for sid, n in segments:
        at = 0
        while at < n and len(out) < max_blocks:
            take = min(n - at, block - filled)
            pieces.append((sid, at, take))
            at += take
            filled += take
            if filled == block:
                h = hash((h, tuple(pieces)))
                out.append(h)
                pieces, filled = [], 0
    return tuple(out)


def _url(part: dict[str, Any]) -> str:
    """What identifies a non-text content part (an image's URL or data), for the cache key."""
    for key in ("image_url", "input_audio", "file", "video_url"):
        v = part.get(key)
        if isinstance(v, dict):
            return str(v.get("url") or v.get("data") or v.get("file_id") or "")[:256]
        if isinstance(v, str):
            return v[:256]
    return ""


def chain_of(doc: dict[str, Any] | None, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """A request body's chain: its prompt text, keyed by its model and ``cache_salt``."""
    if doc is None:
        return ()
    seed = hash((str(doc.get("model")), str(doc.get("cache_salt"))))
    return text_chain(text_of(doc, block_chars * max_blocks), block_chars, max_blocks, seed)


class PrefixIndex:
    """Per node, the prompt blocks kvgate sent there: what vLLM may hold in its prefix cache."""

    def __init__(self, max_blocks_per_node: int, ttl_s: float, max_blocks: int | None = None) -> None:
        self.max_blocks = max_blocks_per_node
        self.ttl = ttl_s
        self.max_total = max_blocks
        """At most this many blocks across all nodes (None: no cap but the per-node one)."""
        self._holders: dict[int, dict[str, float]] = {}
        """Block → node → when it was last sent there."""
        self._lru: dict[str, OrderedDict[int, None]] = {}
        """Node → its blocks, least recently sent first (so in time order: each chain's blocks share a time)."""
        self._size = 0
        self._fronts: list[tuple[float, str]] = []
        """A heap of (no later than when the node's oldest block was sent, node): the globally oldest block
        — the next to expire, the first to go at the cap — without a scan of every node. An entry may be
        older than its node's oldest block now (that block was sent again or dropped since): it is then
        pushed again with the right time when it comes up."""
        self._queued: set[str] = set()
        """Nodes with an entry in ``_fronts``: every node holding blocks has one."""

    def __len__(self) -> int:
        return self._size

    def match(self, chain: Sequence[int], now: float, among: Collection[str] | None = None) -> dict[str, int]:
        """Node → how many of ``chain``'s leading blocks it holds (only nodes holding at least one; of
        ``among`` only, when given: a prompt every node was sent — a common system prompt — is held by
        the whole fleet, and a decision that looks at a sample of it need not walk all of them).

        A node that holds block ``k`` of a chain was sent everything before it (a block's hash covers
        all before it, and :meth:`record` keeps a chain's head the most recently used: vLLM too frees a
        request's blocks tail first), so the longest run is found by bisection: a few lookups per
        distinct run length, not one per block."""
        if not chain:
            return {}
        horizon = now - self.ttl
        first = self._holders.get(chain[0])
        if not first:
            return {}
        if among is None:
            pending = {n for n, at in first.items() if at >= horizon}
        else:
            pending = {n for n in among if first.get(n, -math.inf) >= horizon}
        out: dict[str, int] = {}
        hi = len(chain)
        while pending and hi >= 1:
            lo = 1  # chain[lo - 1] is held by one of ``pending``
            while lo < hi:
                mid = (lo + hi + 1) // 2
                holders = self._holders.get(chain[mid - 1])
                if holders and any(holders.get(n, -math.inf) >= horizon for n in pending):
                    lo = mid
                else:
                    hi = mid - 1
            holders = self._holders.get(chain[lo - 1]) or {}
            who = {n for n in pending if holders.get(n, -math.inf) >= horizon}
            for n in who:
                out[n] = lo
            pending -= who
            hi = lo - 1
        return out

    def deepest(self, chain: Sequence[int], now: float, limit: int) -> list[str]:
        """Up to ``limit`` nodes holding the longest run of ``chain`` that any node holds (none when no
        node holds its first block): where a large fleet looks first. A bisection over the blocks, each
        step asking only whether *some* node holds that block, and no walk over every holder of a block
        the whole fleet was sent (a common system prompt)."""
        horizon = now - self.ttl

        def held(h: int) -> bool:
            holders = self._holders.get(h)
            return holders is not None and any(at >= horizon for at in holders.values())

        if not chain or limit <= 0 or not held(chain[0]):
            return []
        lo, hi = 1, len(chain)  # chain[lo - 1] is held by some node
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if held(chain[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        out: list[str] = []
        for n, at in self._holders[chain[lo - 1]].items():
            if at >= horizon:
                out.append(n)
                if len(out) >= limit:
                    break
        return out

    def record(self, node: str, chain: Sequence[int], now: float) -> None:
        """The blocks of a prompt sent to ``node``: it will hold them (until it evicts them). The whole
        chain, tail first, so that under the per-node limit and the TTL a chain loses its tail before its
        head and what a node holds stays one unbroken run from the start (what :meth:`match` bisects)."""
        lru = self._lru.get(node)
        if lru is None:
            lru = self._lru[node] = OrderedDict()
        holders = self._holders
        before = len(lru)
        for h in reversed(chain):
            holders.setdefault(h, {})[node] = now
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.max_blocks:
            old, _ = lru.popitem(last=False)
            self._drop(old, node)
        self._size += len(lru) - before
        if lru and node not in self._queued:
            heapq.heappush(self._fronts, (holders[next(iter(lru))][node], node))
            self._queued.add(node)
        self.trim(now, 2 * len(chain) + SWEEP_EXTRA)

    def trim(self, now: float, sweep: int) -> None:
        """Drop the oldest blocks while the index holds more than ``max_total``, and up to ``sweep``
        expired ones (their nodes no longer count them in ``match``: only their memory goes)."""
        horizon = now - self.ttl
        fronts, holders = self._fronts, self._holders
        while fronts:
            over = self.max_total is not None and self._size > self.max_total
            at, node = fronts[0]
            if not over and (sweep <= 0 or at >= horizon):
                return
            heapq.heappop(fronts)
            self._queued.discard(node)
            sweep -= 1
            lru = self._lru.get(node)
            if not lru:
                continue
            oldest = holders[next(iter(lru))][node]
            if oldest <= at:  # (else the entry was stale: pushed again below, with the right time)
                h, _ = lru.popitem(last=False)
                self._drop(h, node)
                self._size -= 1
            if lru:
                heapq.heappush(fronts, (holders[next(iter(lru))][node], node))
                self._queued.add(node)

    def clear(self) -> None:
        self._holders.clear()
        self._lru.clear()
        self._fronts.clear()
        self._queued.clear()
        self._size = 0

    def forget(self, node: str) -> None:
        """A node gone (or restarted: its cache is empty). Its entry in the heap stays until it comes up."""
        lru = self._lru.pop(node, None)
        if lru:
            self._size -= len(lru)
            for h in lru:
                self._drop(h, node)

    def _drop(self, h: int, node: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.pop(node, None)
            if not holders:
                del self._holders[h]
