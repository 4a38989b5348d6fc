"""What a simulated request's prompt holds, and the block hashes vLLM's automatic prefix caching keys on.

vLLM (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``, ``generate_block_hash_extra_keys``) hashes
every FULL block of ``block_size`` tokens from the start of a request: block i's hash covers block i-1's
hash, the block's token ids and extra keys (the LoRA id, multimodal hashes, and for block 0 only the
request's ``cache_salt``). Equal hashes therefore mean equal prefixes, and a partial block is never
hashed. The cache itself (reference counts, the LRU free queue) is in ``scheduler``.

No model runs here, so there is no tokenizer and no real token ids. A prompt's tokens are stand-ins,
consistent with how the server counts them:

* ``Prompt.ids`` — real token ids (``/v1/completions`` with a token-id prompt);
* ``Prompt.text`` / ``Prompt.chat`` — an approximation from text: each 4-character chunk is one token
  whose id is a stable function of the chunk (the server counts characters / 4 as tokens); a chat message
  adds 3 header tokens (start, role, end of header) and 1 end-of-turn token around its chunks, as a chat
  template does (the server counts 4 per message). Identical leading messages give identical leading
  tokens; the chunk straddling two messages belongs to the first;
* ``Prompt.segments`` — virtual time: ``[(segment_id, n_tokens), ...]`` describes how the prompt starts;
  token j of a segment is the token (segment_id, j), so requests that start with the same segments share
  their leading full blocks.

Tokens past what the description covers (the rest of the prompt, and every generated token) belong to
the request alone: no other request has them, and only the same request — recomputing after a
preemption — can hit the blocks that hold them. A request with no ``Prompt`` at all (the count-only
virtual-time traces) is not hashed: it never hits and leaves no reusable blocks.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

NONE_HASH = 0x5EED_CAFE_F00D
"""The parent hash of block 0 (vLLM seeds the chain with its own ``NONE_HASH``)."""
CHARS_PER_TOKEN = 4


def stable_id(x: object) -> int:
    """A stable integer for an id: ints as they are, anything else a 64-bit digest of its text. Only ints
    go into the hashed tuples, so block hashes do not depend on ``PYTHONHASHSEED``."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    text = x if isinstance(x, str) else repr(x)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _chunk_id(chunk: str) -> int:
    """A text chunk's token id: its bytes read as one number (stable, and distinct chunks never collide);
    the leading 1 keeps trailing zero bytes apart. Above the 64-bit ids of ``stable_id``."""
    return int.from_bytes(b"\x01" + chunk.encode("utf-8", "surrogatepass"), "big") << 64


def _chunks(text: str) -> list[int]:
    return [_chunk_id(text[i:i + CHARS_PER_TOKEN]) for i in range(0, len(text), CHARS_PER_TOKEN)]


_BOS, _EOH, _EOT = stable_id("<|start_header_id|>"), stable_id("<|end_header_id|>"), stable_id("<|eot_id|>")


class Prompt:
    """A prompt's token content, as much as is known (see the module docstring)."""

    __slots__ = ("_ids", "_segments", "_starts", "length", "salt")

    def __init__(self, ids: Sequence[int] | None = None, segments: Sequence[tuple[object, int]] | None = None,
                 salt: str | None = None) -> None:
        if (ids is None) == (segments is None):
            raise ValueError("a Prompt is token ids or segments")
        self._ids = tuple(ids) if ids is not None else None
        self._segments: tuple[tuple[int, int], ...] = ()
        self._starts: list[int] = []
        at = 0
        for seg, n in segments or ():
            if n < 0:
                raise ValueError(f"segment {seg!r}: negative length {n}")
            if n:
                self._segments += ((stable_id(seg), n),)
                self._starts.append(at)
                at += n
        self.length = len(self._ids) if self._ids is not None else at
        """Tokens described; the prompt may be longer (its tail is the request's own)."""
        self.salt = stable_id(salt) if salt else 0
        """vLLM's ``cache_salt``: an extra key of block 0 only; 0 for none."""

    @classmethod
    def from_ids(cls, ids: Sequence[int], salt: str | None = None) -> Prompt:
        return cls(ids=ids, salt=salt)

    @classmethod
    def from_segments(cls, segments: Sequence[tuple[object, int]], salt: str | None = None) -> Prompt:
        return cls(segments=segments, salt=salt)

    @classmethod
    def from_text(cls, text: str, salt: str | None = None) -> Prompt:
        """A completion prompt: ``max(1, ceil(len / 4))`` tokens, as the server counts it."""
        return cls(ids=_chunks(text) or [stable_id("")], salt=salt)

    @classmethod
    def from_chat(cls, messages: Sequence[tuple[str, str]], salt: str | None = None) -> Prompt:
        """Chat messages as ``(role, text)``: ``4 * len(messages) + ceil(total chars / 4)`` tokens, the
        server's count. The text of all messages is chunked as one string; a chunk goes to the message
        its first character is in."""
        ids: list[int] = []
        at = 0
        joined = "".join(text for _, text in messages)
        for role, text in messages:
            ids += (_BOS, stable_id(role), _EOH)
            end = at + len(text)
            first = -(-at // CHARS_PER_TOKEN) * CHARS_PER_TOKEN  # the first chunk that starts in this message
            ids += (_chunk_id(joined[i:i + CHARS_PER_TOKEN]) for i in range(first, end, CHARS_PER_TOKEN))
            ids.append(_EOT)
            at = end
        return cls(ids=ids, salt=salt)

    def block_key(self, start: int, end: int, prompt_len: int, own: int) -> tuple[object, ...]:
        """The tokens at positions ``[start, end)`` as a hashable of ints: equal keys, equal tokens.
        Positions past what this prompt describes (or past ``prompt_len``: generated tokens) are the
        request's own, keyed by ``own`` (unique per request in a scheduler)."""
        known = min(self.length, prompt_len)
        head: tuple[object, ...] = ()
        if start < known:
            stop = min(end, known)
            if self._ids is not None:
                head = self._ids[start:stop]
            else:  # runs of (segment, first, last) — the same as listing (segment, j) token by token
                i = bisect.bisect_right(self._starts, start) - 1
                runs = []
                pos = start
                while pos < stop:
                    seg, n = self._segments[i]
                    base = self._starts[i]
                    upto = min(stop, base + n)
                    runs.append((seg, pos - base, upto - base))
                    pos = upto
                    i += 1
                head = tuple(runs)
        if end > known:
            return (head, (own, max(start, known), end))
        return (head,)


def extend_hashes(prompt: Prompt, hashes: list[int], n_blocks: int, block_size: int, prompt_len: int,
                  own: int) -> list[int]:
    """Extend ``hashes`` (a request's block hashes so far) to ``n_blocks`` full blocks, chained as vLLM's
    ``hash_block_tokens`` does: ``hash((parent, tokens, extra_keys))``; block 0's parent is ``NONE_HASH``
    and its extra key the cache salt."""
    parent = hashes[-1] if hashes else NONE_HASH
    for i in range(len(hashes), n_blocks):
        key = prompt.block_key(i * block_size, (i + 1) * block_size, prompt_len, own)
        parent = hash((parent, key, prompt.salt if i == 0 else 0))
        hashes.append(parent)
    return hashes


class Block:
    """A full KV block with a hash: in use (``ref`` > 0) or an eviction candidate in the free queue."""

    __slots__ = ("hash", "ref")

    def __init__(self, block_hash: int) -> None:
        self.hash = block_hash
        self.ref = 1


class BlankRun:
    """Free blocks without a hash, consecutive in the free queue (one entry, however many)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n
