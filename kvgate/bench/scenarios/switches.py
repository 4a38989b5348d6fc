"""kvgate's mechanisms, each switched off by its own configuration: what ``kvgate bench ablation`` runs.

An ablation only says what a mechanism buys if the run without it is a configuration of the production
core an operator could deploy, not a re-implementation in the bench. So each switch here rewrites
kvgate's config document (``Config.model_dump(mode="json")``) and nothing else; the core, the
simulated nodes and the report are the same as for the full ``kvgate`` row. The SLOs the rows are
*measured* against stay the scenario's own (the report reads the base config's tiers), whatever a
switch does to the targets kvgate itself steers by.

``SWITCHES`` (names are an interface: CLI, JSON):

* ``quotas`` — every tenant's protective limits removed: ``max_concurrent``, ``requests_per_minute``,
  ``request_burst``, ``tokens_per_minute``, ``token_burst`` and ``model_budgets`` (request validity caps
  such as ``max_prompt_tokens`` stay: they are not quotas);
* ``queue`` — ``queue.enabled: false``: no gateway queue, a request no node can take now is a 503;
* ``priority`` — ``queue.inject_priority: false``: no vLLM priority in the bodies, so the simulated nodes
  run first-come first-served (tiers still order kvgate's own queue and reserve KV);
* ``breakers`` — ``nodes.breaker.enabled: false`` (every pool's): no node is ever ejected;
* ``predictions`` — every tier's ``ttft_target_ms`` unset for kvgate: node choice still goes to the
  soonest predicted first token, but nothing is driven by a TTFT target any more (no ``fleet-queue``
  refusal of a request no node can serve in time, no isolation of long prefills from the top tier, the
  queue holds requests to ``max_queue_wait_ms`` rather than to the target, no SLO-miss demand signal);
* ``prefix`` — ``nodes.prefix.enabled: false`` (every pool's): no prefix-cache affinity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

QUOTA_FIELDS = ("max_concurrent", "requests_per_minute", "request_burst", "tokens_per_minute", "token_burst")
"""A tenant's protective limits (``ext_proc.config.Quota``), besides its ``model_budgets``."""


def _nodes_sections(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ``nodes`` section of the document: the top-level one, or each pool's."""
    if doc.get("pools"):
        return [p["nodes"] for p in doc["pools"] if p.get("nodes") is not None]
    return [doc["nodes"]] if doc.get("nodes") is not None else []


def _quotas(doc: dict[str, Any]) -> None:
    for t in doc.get("tenants", []):
        for k in QUOTA_FIELDS:
            t[k] = None
        t["model_budgets"] = {}


def _queue(doc: dict[str, Any]) -> None:
    doc.setdefault("queue", {})["enabled"] = False


def _priority(doc: dict[str, Any]) -> None:
    doc.setdefault("queue", {})["inject_priority"] = False


def _breakers(doc: dict[str, Any]) -> None:
    for nodes in _nodes_sections(doc):
        nodes["breaker"] = {**(nodes.get("breaker") or {}), "enabled": False}


def _predictions(doc: dict[str, Any]) -> None:
    for tier in (doc.get("tiers") or {}).values():
        tier["ttft_target_ms"] = None


def _prefix(doc: dict[str, Any]) -> None:
    for nodes in _nodes_sections(doc):
        nodes["prefix"] = {**(nodes.get("prefix") or {}), "enabled": False}


SWITCHES: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "quotas": ("tenants' concurrency/rate/token limits removed", _quotas),
    "queue": ("queue.enabled: false", _queue),
    "priority": ("queue.inject_priority: false", _priority),
    "breakers": ("nodes.breaker.enabled: false", _breakers),
    "predictions": ("tiers' ttft_target_ms unset (no TTFT/SLO-driven control)", _predictions),
    "prefix": ("nodes.prefix.enabled: false", _prefix),
}
"""Switch name → (what it sets, in words; the rewrite of the config document)."""


def switch_off(doc: dict[str, Any], off: Iterable[str]) -> dict[str, Any]:
    """``doc`` (a config document, changed in place and returned) with the mechanisms ``off`` switched
    off; an unknown name is a ValueError naming the known ones."""
    for name in off:
        if name not in SWITCHES:
            raise ValueError(f"unknown mechanism {name!r}; known: {', '.join(SWITCHES)}")
        SWITCHES[name][1](doc)
    return doc
