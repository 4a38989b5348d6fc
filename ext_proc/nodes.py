"""Which vLLM node takes a request: :class:`Fleet`, a node book with a picker.

Shaped like the Gateway API Inference Extension's scheduler, in two parts:

* the **node book** (``nodebook.py``: ``Node``, ``NodeBook``, ``Room``) — readings, bookings, the
  prefill clocks, breakers, the prefix index, and the room summary that says at once whether any node
  can take a tier's request;
* the **picker** (``picker.py``: ``Picker``) — filters, predictions, the pick; see its docstring for
  how a node is chosen.

:meth:`Fleet.place` chooses and books. The names callers import (``Choice``, ``Level``, ``Node``, the
scan limits) are re-exported here. Pure: time and randomness are injected; the server feeds it probe
snapshots from a background follower.
"""

from __future__ import annotations

from .nodebook import DEFAULT_BLOCK, Level, Node, NodeBook, Room, breaker_settings
from .picker import MAX_CANDIDATES, SCAN_LIMIT, TOP_RECENT_S, Choice, Picker

__all__ = ["DEFAULT_BLOCK", "MAX_CANDIDATES", "SCAN_LIMIT", "TOP_RECENT_S", "Choice", "Fleet", "Level", "Node",
           "NodeBook", "Picker", "Room", "breaker_settings"]


class Fleet(Picker):
    """A pool's nodes: the node book and the picker over it; what the core holds per pool."""

    def place(
        self, tokens: int, prompt_tokens: int, ticket: str, now: float, force: bool = False, reserve: float = 0.0,
        queue_caps: bool = True, priority: int = 0, target: float | None = None, limit: float | None = None,
        prefix: tuple[int, ...] = (), retry: bool = True, adapter: str | None = None, urgent: bool | None = None,
        owed: bool = False,
    ) -> Choice:
        """Choose a node and book the request there (what ``Admission`` calls). ``prefix``: the chain of
        the prompt's leading blocks (``prefix.py``), for prefix-cache affinity. ``adapter``: the LoRA adapter
        it runs with (one of the pool's ``adapters``), for adapter affinity."""
        c = self.choose(tokens, now, force, prompt_tokens, reserve, queue_caps, priority, target, limit, prefix,
                        retry, adapter, urgent, owed)
        if c.node is not None:
            # its KV counts whole (vLLM takes cached blocks nobody uses back out of the free pool: usage
            # rises by the whole prompt), its prefill only what is not cached
            self.dispatched(c.node.address, ticket, tokens, prompt_tokens - c.hit, now, priority, c.ttft, adapter)
            if urgent and target is not None and c.ttft is not None:
                if c.ttft > target:
                    # predicted past its target (a prompt too long for it: ``Picker._late_anyway``; or the work
                    # ahead), it waits on no target there: it only makes those waiting later by its share. (An
                    # on-time one shares their step too, and is not counted: left as it was measured)
                    self._packed_beside(c.node, prompt_tokens - c.hit, now)
                else:
                    c.node.top_due.append((now + c.ttft, now + target))
            elif urgent is False and c.node.top_due:
                self._packed_beside(c.node, prompt_tokens - c.hit, now)
            if prefix and self.cfg.prefix.enabled:
                self.prefix.record(c.node.address, prefix, now)
        return c
