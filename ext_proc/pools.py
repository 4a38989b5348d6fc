"""Model pools: which set of nodes serves a request's ``model``, and which models a tenant may use.

A config without ``pools`` is one pool named ``default`` that serves every model on the nodes of
``nodes`` (or on Envoy's own cluster when there are none): every request routes there, whatever its
``model`` says, as before pools existed. With ``pools``, the body's ``model`` picks the pool: an exact
name (or LoRA adapter) first, then the first pool in file order whose pattern matches; a model several
pools serve with weights goes to one of them at random in proportion to the weights.

Pure, like the rest of the core: the RNG is injected. Resolutions are cached (model names come from
clients: the caches are bounded by entries and by bytes, least recently used first out, and a name
nobody serves is not cached; a name longer than ``limits.max_model_name_chars`` never gets here).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import unquote

from .bounds import LruCache
from .config import Config, Nodes, Tenant, is_pattern
from .reasons import Rejection, reject

DEFAULT_POOL = "default"
"""The pool of a config without ``pools``."""
NO_POOL = "none"
"""The ``pool`` label of a request refused before it was routed (no key, a bad body, an unknown model)."""
_CACHE_MAX = 4096
_CACHE_BYTES = 1 << 20
"""Each resolution cache holds at most this many bytes of model names (and ``_CACHE_MAX`` entries):
a pattern pool matches names of any length, and 4,096 four-megabyte names were 16 GB."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool as the core uses it."""

    name: str
    nodes: Nodes | None
    queue_max_size: int
    exact: tuple[str, ...]
    """The model and adapter names it serves exactly."""
    patterns: tuple[str, ...]
    weight: float | None
    models: tuple[str, ...] = ()
    """The exact model names (not adapters), for GET /v1/models."""
    adapters: tuple[str, ...] = ()


def pools_of(config: Config) -> list[PoolSpec]:
    """The pools a config defines: its ``pools``, or the one default pool."""
    if not config.pools:
        return [PoolSpec(DEFAULT_POOL, config.nodes, config.queue.max_size, (), ("*",), None)]
    out = []
    for p in config.pools:
        exact = tuple(m for m in p.models if not is_pattern(m))
        out.append(PoolSpec(p.name, p.nodes, p.queue.max_size or config.queue.max_size, exact + tuple(p.adapters),
                            tuple(m for m in p.models if is_pattern(m)), p.weight, exact, tuple(p.adapters)))
    return out


class Router:
    """``model`` → pool; entitlements and per-model budget keys of tenants."""

    def __init__(self, config: Config, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()
        self.pools = pools_of(config)
        self.by_name = {p.name: p for p in self.pools}
        self.single = not config.pools
        """No ``pools`` in the config: every request goes to the default pool, whatever its model."""
        self._exact: dict[str, list[PoolSpec]] = {}
        for p in self.pools:
            for m in p.exact:
                self._exact.setdefault(m, []).append(p)
        self._cache: LruCache[str, tuple[PoolSpec, ...]] = LruCache(_CACHE_MAX, _CACHE_BYTES)
        self._allowed: LruCache[tuple[str, str], bool] = LruCache(_CACHE_MAX, _CACHE_BYTES)

    def candidates(self, model: str) -> tuple[PoolSpec, ...]:
        """The pools that serve ``model`` (several only when weighted); empty: none does."""
        hit = self._cache.get(model)
        if hit is not None:
            return hit
        found = self._exact.get(model)
        if found is None:
            matching = [p for p in self.pools if any(fnmatchcase(model, pat) for pat in p.patterns)]
            weighted = [p for p in matching if p.weight is not None]
            found = weighted if len(weighted) > 1 else matching[:1]
        out = tuple(found)
        if out:
            self._cache.put(model, out)
        return out

    def route(self, model: str | None) -> PoolSpec | None:
        """The pool a request for ``model`` goes to; None when no pool serves it (or, with several pools,
        when the request names no model)."""
        if self.single:
            return self.pools[0]
        if model is None:
            return None
        c = self.candidates(model)
        if len(c) <= 1:
            return c[0] if c else None
        weights = [p.weight or 0.0 for p in c]
        return self.rng.choices(c, weights)[0]

    def allowed(self, tenant: Tenant | None, model: str | None) -> bool:
        """Whether ``tenant`` may use ``model`` (its ``models`` list, names or patterns)."""
        if tenant is None or tenant.models is None or model is None:
            return True
        key = (tenant.name, model)
        ok = self._allowed.get(key)
        if ok is None:
            ok = any(m == model or (is_pattern(m) and fnmatchcase(model, m)) for m in tenant.models)
            self._allowed.put(key, ok)
        return ok

    @staticmethod
    def budget_key(tenant: Tenant, model: str | None) -> str | None:
        """The key of the tenant's ``model_budgets`` entry that applies to ``model``: an exact key, else
        the first pattern that matches; None: no per-model budget."""
        if not tenant.model_budgets or model is None:
            return None
        if model in tenant.model_budgets:
            return model
        for key in tenant.model_budgets:
            if is_pattern(key) and fnmatchcase(model, key):
                return key
        return None

    def model_entry(self, tenant: Tenant | None, model: str) -> dict[str, Any] | None:
        """GET /v1/models/{model}: its entry when a pool serves it and ``tenant`` may use it."""
        entries: list[dict[str, Any]] = self.listing(tenant)["data"]
        for m in entries:
            if m["id"] == model:
                return m
        if model and not self.single and self.candidates(model) and self.allowed(tenant, model):
            return _entry(model)  # a name a pool serves by pattern
        return None

    def listing(self, tenant: Tenant | None) -> dict[str, Any]:
        """GET /v1/models: the models (exact names and adapters) ``tenant`` may use, OpenAI's shape.
        Patterns are not listed: they name no model in particular."""
        named: list[tuple[str, str | None]]
        if self.single:  # no pools: what the tenant's own list names exactly (its patterns name no model)
            named = [(m, None) for m in (tenant.models or [] if tenant is not None else []) if not is_pattern(m)]
        else:
            named = [(n, parent) for p in self.pools
                     for n, parent in [(m, None) for m in p.models] + [(a, p.models[0] if p.models else None)
                                                                       for a in p.adapters]]
        data: list[dict[str, Any]] = []
        seen: set[str] = set()
        for name, parent in named:
            if name not in seen and (self.single or self.allowed(tenant, name)):
                seen.add(name)
                data.append(_entry(name, parent))
        return {"object": "list", "data": data}


def model_id(path: str, max_chars: int) -> str | Rejection:
    """The model ``GET /v1/models/{id}`` asks for (``path`` without its query): the id percent-decoded
    once — the openai SDK's ``models.retrieve()`` sends ``meta-llama%2FLlama-3.1-70B`` for a model
    ``models.list()`` returned as ``meta-llama/Llama-3.1-70B``; decoding twice would turn a name's own
    ``%2F`` into a ``/`` — or a 400 ``invalid-parameter`` for an id longer than ``max_chars`` (the
    name cap requests have), which names no model and is not looked up."""
    raw = path.removeprefix("/v1/models/")
    name = unquote(raw) if "%" in raw and len(raw) <= 3 * max_chars else raw  # (a %XX is 3 characters)
    if len(name) > max_chars:
        return reject("invalid-parameter", f"The model id is {len(name)} characters long; this gateway accepts "
                      f"model names of at most {max_chars}.", param="model")
    return name


def _entry(name: str, parent: str | None = None) -> dict[str, Any]:
    """One model (or adapter, with its base model as ``parent``) as OpenAI's ``/v1/models`` lists it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvgate", "root": parent or name,
            "parent": parent}
