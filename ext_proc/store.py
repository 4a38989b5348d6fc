"""The store several kvgate replicas share: Redis (or Valkey), at the edge.

Nothing here decides anything: the arithmetic of slices is in ``share.py``, the decisions in
``admission.py``. This module moves state between the core and Redis, off the request path:

* **sync**, every ``sync_interval_ms``, one pipelined round trip: a heartbeat (the live replicas, the
  store's epoch), each active tenant's slots (max-min fair by demand, computed by a Lua script so that
  the read-compute-write is atomic) and budget credit (leased from, or given back to, one bucket per
  tenant and budget, refilled in Redis by Redis's own clock), and the replica's events — fair-share
  service it gave, requests it sent to nodes, completions that reached it for tickets another replica
  owns, Envoys it found gone — appended to one stream every replica reads (trimmed after 30 s: a
  forwarded completion also waits in its owner's inbox, read and emptied at each of the owner's syncs);
* **borrow**, one round trip on the request path, only when a tenant's slice here cannot pay for a
  request and the fleet's may (``core.Borrow``): a 429 still means the tenant is over its quota
  fleet-wide, not over this replica's slice of it.

Exactness of ``max_concurrent``: the store grants only slots nobody holds, and its record of a replica
never drops below what that replica admits on — the replica reports what it enforces with every call,
lowers its own slice when told, and the next report lowers the record. One slots call per tenant is on
its way at a time (a per-tenant lock), so a report is never stale. A replica that dies leaves its slots
as *orphans*: its requests still run; each completion forwarded for it gives one back, the rest expire
after ``server.lease_timeout_seconds``.

Failures: a sync that fails marks the store down (``kvgate_store_up`` 0); failing for
``fallback_after_seconds`` makes the replica enforce an even split of every limit among the replicas it
last saw alive, at least ``expected_replicas`` (``Admission.share_local``). When Redis answers again the
replica rejoins: a learning period starts, its budgets become leased credit again and what it spent
meanwhile is debited; its slots are reported as what it enforces. A Redis that restarted empty has a new
epoch: scripts refuse calls made for the old one, and for one lease TTL (the *learning period*) no
replica's slots grow and new buckets start empty, while each replica's report rebuilds the record of
what it holds.

All keys share one hash tag (``{prefix}``); the client is a plain (not a cluster) client.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import NoScriptError, RedisError

from . import logs
from .admission import Usage
from .config import Config, RedisStore
from .core import Core, Ended
from .quota import ShareReport
from .share import ORPHANED, with_expected

log = logs.get("kvgate.store")

EVENTS_KEEP_MS = 30_000
"""Events older than this are trimmed from the stream: a replica further behind skips ahead."""
BORROW_BUDGET_S = 0.6
"""A decision that borrows (and perhaps waits for a slot idle at another replica) is answered within
this, whatever ``timeout_ms`` says: well under the ext_proc ``message_timeout`` of the generated Envoy
config (1 s), past which Envoy answers 503 itself — or, fail-open, lets the request through undecided."""
HEIRS_REWRITE_S = 10.0
"""A tenant's heirs unchanged are written again this often all the same: a list the store lost (an error, a restart
empty) comes back."""
Forward = tuple[str, str, str, str, bool, bytes]
"""A completion to forward through END: (owner, ticket, tenant or "-", per-model budget, sent on the tenant's cap's
stretch, the event)."""
MAX_ENDS = 20_000
"""Completions waiting to be forwarded while Redis is away; beyond it the oldest are dropped (their
slots come back by reclaim)."""
ENDS_PER_BATCH = 2_000

CONFLICT_AFTER_S = 60.0
"""The same live replicas on one ``key_prefix`` running other quotas for this long are taken for
another release sharing the prefix (a config reload reaches a release's replicas within seconds; a
rolling restart brings a new replica, or takes an old one away, more often than this — each change of
who differs restarts the clock): each then runs on its local split instead of sharing state."""
QUOTA_FIELDS = {"name", "max_concurrent", "requests_per_minute", "request_burst", "tokens_per_minute",
                "token_burst", "model_budgets"}


def quota_fingerprint(cfg: Config) -> str:
    """What the replicas sharing one ``key_prefix`` must agree on: every tenant's name and shared limits
    (12 hex digits of a SHA-256)."""
    doc = sorted((t.model_dump(mode="json", include=QUOTA_FIELDS) for t in cfg.tenants), key=lambda d: d["name"])
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]


LUA = Path(__file__).with_name("lua")
"""The Redis scripts, one ``.lua`` file each (packaged with ext_proc; ``tests/test_store_lua.py`` runs them
on a real ``redis-server``)."""


def _script(name: str) -> str:
    return (LUA / f"{name}.lua").read_text()


FAIR = _script("fair")
HELLO = _script("hello")
SLOTS = FAIR + _script("slots")
"""``fair`` is a function slots.lua calls: prepended, as Redis scripts cannot import."""
END = _script("end")
BUCKET = _script("bucket")

SCRIPTS = {"hello": HELLO, "slots": SLOTS, "end": END, "bucket": BUCKET}

Remote = tuple[dict[str, float], list[tuple[str, int, int, str]], list[list[Any]], list[str]]
"""One event batch of another replica: service given, requests sent to nodes, completions forwarded,
Envoys found gone."""


class SharedStore:
    """One replica's link to the store: its sync loop, its borrows, its forwarded completions."""

    def __init__(self, cfg: RedisStore, core: Core, registry: CollectorRegistry,
                 on_change: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.core = core
        self.on_change = on_change or _nothing
        """Called after the store changed what the core may admit (a sync, the local split): the shell
        hands the answers of requests it freed to their streams now, not at its next tick."""
        self.me = core.admission.replica
        self.orphan_ttl_ms = int(core.config.server.lease_timeout_seconds * 1000)
        password = cfg.password_file.read_text().strip() if cfg.password_file is not None else None
        timeout = cfg.timeout_ms / 1000.0
        kw: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                              "retry_on_timeout": False, "protocol": 2}
        if password is not None:
            kw["password"] = password
        if cfg.tls_ca_file is not None:
            kw["ssl_ca_certs"] = str(cfg.tls_ca_file)
        self.client: Any = aioredis.Redis.from_url(cfg.url, **kw)
        self._sha: dict[str, str] = {}
        p = "{" + cfg.key_prefix + "}"
        self.k_replicas, self.k_epoch, self.k_learning, self.k_events, self.k_over, self.k_version = (
            f"{p}:replicas", f"{p}:epoch", f"{p}:learning", f"{p}:events", f"{p}:over", f"{p}:version")
        self._prefix = p
        self.k_config = f"{p}:config"
        """Replica → the fingerprint of its quota config (``quota_fingerprint``)."""
        self._fp: tuple[Config, str] | None = None
        self._differs_since = 0.0
        self._differ: tuple[str, ...] = ()
        """The live replicas running other quotas, as last read, and since when exactly these."""
        self._config_stale: list[str] = []
        self.conflict = False
        """Another release's replicas share this ``key_prefix`` (:meth:`_check_config`): this replica
        runs on its local split and shares no state until they agree again."""
        self.epoch = ""
        self.live: list[str] = [self.me]
        self.holdings: dict[str, dict[str, int]] = {}
        """Tenant → replica → slots held, as last read: what a fallback split corrects for."""
        self.learning = False
        self._versions: dict[str, int] = {}
        """Tenant → the newest slots answer applied."""
        self._busy: dict[str, asyncio.Event] = {}
        """Tenants with a slots call on its way (set when it is back): one at a time per tenant, so what a
        call reports is what the replica enforces; a borrow waits for the call before it, a sync skips
        the tenant."""
        self._sent_cap: dict[str, int] = {}
        """The cap each tenant's last slots call was made with: an answer for another cap (a reload
        meanwhile) is dropped."""
        self.last_id: str | None = None
        self._seq = 0
        self._batch: bytes | None = None
        """The events sent and not yet known to have arrived: sent again, with the same sequence in it,
        until a sync succeeds (readers skip the sequences they have seen)."""
        self._seen: dict[str, int] = {}
        self._ends: list[list[Any]] = []
        """Completions without a ticket, for every replica: [owner '*', '', request id, status, prompt,
        completion, upstream answered, disconnected]."""
        self._forward: list[Forward] = []
        """Completions for another replica's tickets (``Forward``): the END script hands each to its owner, or,
        when the owner died, gives one of its slots back."""
        self._heirs_sent: dict[str, tuple[frozenset[str], float]] = {}
        self._heirs_asked: dict[str, tuple[frozenset[str], float]] = {}
        """Per tenant, the heirs the store last confirmed it wrote, and when; and those a slots call on its way
        writes (``_slots_call``): a call that failed or was refused leaves the next to write them all again."""
        self._failing_since: float | None = None
        self._sync_started = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self.ok = False
        r = registry
        self.up_gauge = Gauge("kvgate_store_up", "1 while this replica's last sync with the shared store "
                              "succeeded; 0 while it fails (after store.redis.fallback_after_seconds each "
                              "replica enforces an even local split of every limit)", registry=r)
        self.replicas_gauge = Gauge("kvgate_store_replicas", "kvgate replicas alive as the store last said",
                                    registry=r)
        self.fallback_gauge = Gauge("kvgate_store_fallback", "1 while this replica enforces its local split "
                                    "of every limit because the store cannot be reached (or another release with other "
                                    "quotas shares its store.redis.key_prefix)", registry=r)
        self.sync_seconds = Histogram("kvgate_store_sync_duration_seconds", "One sync with the shared store",
                                      buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                                      registry=r)
        self.borrows = Counter("kvgate_store_borrows_total", "Round trips to the store to borrow before "
                               "refusing a request, by result: granted | refused | error", ["result"], registry=r)
        self.borrow_waits = Counter("kvgate_store_borrow_waits_total", "Syncs a slot borrow waited because every "
                                    "slot of the tenant was held but fewer requests than its cap ran fleet-wide "
                                    "(an idle slot moving to this replica)", registry=r)
        self.errors = Counter("kvgate_store_errors_total", "Failed calls to the shared store", ["op"], registry=r)
        self.forwarded = Counter("kvgate_store_forwarded_completions_total", "Completions for tickets another "
                                 "replica owns: sent (forwarded to it) | received (from another) | orphan (its "
                                 "replica had died: the slot goes back to the fleet) | dropped (too many waiting "
                                 "while Redis was away)", ["direction"], registry=r)
        self.up_gauge.set(0)

    # -- keys and scripts ------------------------------------------------------------------------

    def _k_slots(self, tenant: str) -> str:
        return f"{self._prefix}:c:{tenant}"

    def _k_heirs(self, tenant: str, replica: str) -> str:
        """The tickets of ``replica``'s heirs of ``tenant`` (``TenantState.heirs``): END gives the slot of a
        completion forwarded with ``stretched`` back only for one of them."""
        return f"{self._prefix}:heirs:{tenant}:{replica}"

    def _forget_heirs(self, tenant: str | None = None) -> None:
        """What the store wrote of ``tenant``'s heirs (every tenant's: None) is not known: the next slots call
        writes them all."""
        for d in (self._heirs_sent, self._heirs_asked):
            if tenant is None:
                d.clear()
            else:
                d.pop(tenant, None)

    def _k_inbox(self, replica: str) -> str:
        """Completions forwarded to ``replica`` (``end.lua``): kept until it reads them, unlike the
        stream, which is trimmed after ``EVENTS_KEEP_MS``."""
        return f"{self._prefix}:inbox:{replica}"

    def _k_bucket(self, tenant: str, dim: str) -> str:
        return f"{self._prefix}:b:{tenant}:{dim}"

    async def _load(self) -> None:
        """Load the scripts (once, and again after Redis lost them): EVALSHA then costs no extra round
        trip (redis-py's Script objects check SCRIPT EXISTS before every pipeline)."""
        sha = {}
        for name, src in SCRIPTS.items():
            async with asyncio.timeout(self.cfg.timeout_ms / 1000.0):
                sha[name] = await self.client.script_load(src)
        self._sha = sha  # all or none: a call never finds one missing

    def _call(self, pipe: Any, name: str, keys: list[str], args: list[Any]) -> None:
        pipe.evalsha(self._sha[name], len(keys), *keys, *args)

    def _slots_call(self, pipe: Any, tenant: str, cap: int, enforced: int, inflight: int, demand: int,
                    spare: bool, borrow: bool, stays: int | None = None, heirs: frozenset[str] | None = None) -> None:
        """``heirs``: the tenant's heirs here (``TenantState.heirs``), written only when they differ from what
        the store last confirmed or that is ``HEIRS_REWRITE_S`` old (attack110 M3: at 10,000 unchanged heirs the
        whole list cost 8 ms of Redis time a sync); None: as they are (a borrow: the next sync writes them —
        written by the borrow too, a small cap sent in pairs through 3 replicas, ``test_store``, was refused as
        over its cap in ~1 run in 6, for a reason not found)."""
        self._sent_cap[tenant] = cap
        now = time.monotonic()
        last = self._heirs_sent.get(tenant)
        self._heirs_asked.pop(tenant, None)
        if heirs is not None and (last is None or last[0] != heirs or now - last[1] >= HEIRS_REWRITE_S):
            self._heirs_asked[tenant] = (heirs, now)  # confirmed by the answer (``_slots_result``)
            listed: tuple[str, ...] = tuple(heirs)
        else:
            listed = ("=",)  # (no ticket is '=')
        self._call(pipe, "slots",
                   [self.k_replicas, self._k_slots(tenant), self.k_learning, self.k_over, self.k_epoch,
                    self.k_version, self._k_heirs(tenant, self.me)],
                   [self.me, cap, enforced, inflight, demand, int(spare), int(self.cfg.lease_ttl_seconds * 1000),
                    int(borrow), tenant, self.epoch, self.orphan_ttl_ms, inflight if stays is None else stays,
                    *listed])

    def _bucket_call(self, pipe: Any, tenant: str, dim: str, rate: float, capacity: float, amount: float,
                     partial: bool) -> None:
        self._call(pipe, "bucket", [self._k_bucket(tenant, dim), self.k_learning, self.k_epoch],
                   [repr(rate), repr(capacity), repr(amount), int(partial), self.epoch])

    def _claim(self, tenant: str) -> bool:
        """Mark a slots call for ``tenant`` on its way; False when one already is."""
        if tenant in self._busy:
            return False
        self._busy[tenant] = asyncio.Event()
        return True

    def _done(self, tenants: list[str]) -> None:
        for t in tenants:
            ev = self._busy.pop(t, None)
            if ev is not None:
                ev.set()

    # -- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        interval = self.cfg.sync_interval_ms / 1000.0
        while True:
            await self.sync()
            await asyncio.sleep(interval)

    async def sync(self) -> bool:
        """One round trip; True when it succeeded."""
        t0 = time.perf_counter()
        self._sync_started = time.monotonic()
        adm = self.core.admission
        try:
            if not self._sha:
                await self._load()
        except (TimeoutError, RedisError, OSError) as e:
            self._failed(e)
            return False
        interval = self.cfg.sync_interval_ms / 1000.0
        rejoining = adm.local_split > 0
        reports: list[ShareReport] = [] if rejoining else adm.share_report(len(self.live), interval)
        pipe = self.client.pipeline(transaction=False)
        # (a replica kept on its split by another release's config does not restart the learning period)
        self._call(pipe, "hello", [self.k_replicas, self.k_epoch, self.k_learning, self.k_over],
                   [self.me, int(self.cfg.lease_ttl_seconds * 1000), secrets.token_hex(8), self.epoch,
                    self._k_slots(""), int(rejoining and not self.conflict)])
        pipe.hset(self.k_config, self.me, self._fingerprint())
        pipe.hgetall(self.k_config)
        pipe.pexpire(self.k_config, max(int(self.cfg.lease_ttl_seconds * 20_000), 60_000))
        stale, self._config_stale = self._config_stale, []
        if stale:
            pipe.hdel(self.k_config, *stale)
        calls: list[tuple[str, str, str]] = []
        claimed: list[str] = []
        forward, self._forward = self._forward, []
        try:
            for r in reports:
                if r.cap is not None and r.demand is not None and self._claim(r.tenant):
                    claimed.append(r.tenant)
                    self._slots_call(pipe, r.tenant, r.cap, r.slots, r.inflight, r.demand, r.spare, borrow=False,
                                     stays=r.stays, heirs=r.heirs)
                    calls.append(("slots", r.tenant, ""))
                for dim, op in (("requests", r.requests), ("tokens", r.tokens)):
                    if op is not None and op[2] != 0:
                        per_minute, capacity, amount = op
                        self._bucket_call(pipe, r.tenant, dim, per_minute / 60.0, capacity, amount, partial=True)
                        calls.append(("bucket", r.tenant, dim))
            for owner, ticket, tenant, budget, stretched, event in forward:
                keys = [self.k_replicas, self.k_events, self._k_slots(tenant), f"{self._prefix}:ended:{owner}",
                        self._k_inbox(owner), self._k_heirs(tenant, owner)]
                if budget:
                    keys.append(self._k_slots(budget))
                self._call(pipe, "end", keys, [owner, ticket, event, self.orphan_ttl_ms, int(stretched)])
                calls.append(("end", tenant, ""))
            batch = self._next_batch()
            if batch is not None:
                pipe.xadd(self.k_events, {"b": batch}, minid=self._minid(), approximate=True)
                calls.append(("xadd", "", ""))
            if self.last_id is None:
                pipe.xrevrange(self.k_events, count=1)
                calls.append(("last", "", ""))
            else:
                pipe.xread({self.k_events: self.last_id}, count=10_000)
                calls.append(("read", "", ""))
            pipe.lpop(self._k_inbox(self.me), ENDS_PER_BATCH)
            calls.append(("inbox", "", ""))
            try:
                async with asyncio.timeout(2 * self.cfg.timeout_ms / 1000.0):
                    results = await pipe.execute(raise_on_error=False)
            except (TimeoutError, RedisError, OSError) as e:
                # completions to forward go again (END is idempotent per ticket; an event twice is
                # released once); credit given back is lost to the fleet, never spent twice
                self._forward[:0] = forward
                self._forget_heirs()  # (maybe never written: all again at the next sync)
                self._failed(e)
                return False
            finally:
                await pipe.reset()
            return self._apply(results, calls, forward, rejoining, t0)
        finally:
            self._done(claimed)

    def _fingerprint(self) -> str:
        cfg = self.core.config
        if self._fp is None or self._fp[0] is not cfg:  # once per config, not per sync
            self._fp = (cfg, quota_fingerprint(cfg))
        return self._fp[1]

    def _check_config(self, res: Any) -> None:
        """Two releases on one ``key_prefix`` would silently share slots and buckets (a cap-2 release
        got 1 slot, a cap-6 release 5). Live replicas whose quota configs differ for
        ``CONFLICT_AFTER_S`` are another release: this replica logs an error naming the key and runs on
        its local split among the replicas that run its own config — never over its own limits,
        whatever the other release does — until they agree. A shorter difference is one release
        reloading or rolling out a new config: it goes on sharing (replicas of one release must not
        lock each other out). Both sides do the same."""
        mine = self._fingerprint()
        fields = {_str(k): _str(v) for k, v in (res or {}).items()}
        live = set(self.live)
        self._config_stale = [r for r in fields if r not in live][:100]
        differ = sorted(r for r, fp in fields.items() if r in live and r != self.me and fp != mine)
        now = time.monotonic()
        if not differ:
            self._differ = ()
            if self.conflict:
                self.conflict = False
                log.info("store_config_agrees", key_prefix=self.cfg.key_prefix,
                         note="every replica on this key prefix runs the same quotas: sharing again")
            return
        if tuple(differ) != self._differ:
            # a rolling change in progress changes who differs (replicas come and go): its own clock
            first = not self._differ
            self._differ, self._differs_since = tuple(differ), now
            if first:
                log.warning("store_config_differs", key_prefix=self.cfg.key_prefix, replicas=differ[:10],
                            note=f"replicas on this store.redis.key_prefix run other quotas; fine during a "
                            f"reload or a rolling change, taken for another release after {CONFLICT_AFTER_S:.0f} s")
        if self.conflict or now - self._differs_since < CONFLICT_AFTER_S:
            return
        self.conflict = True
        adm = self.core.admission
        log.error("store_key_prefix_shared", field="store.redis.key_prefix", key_prefix=self.cfg.key_prefix,
                  fingerprint=mine, replicas=differ[:10],
                  note="another release with other quotas uses the same store.redis.key_prefix: give each "
                  "release its own; until then this replica enforces its local split and shares nothing")
        if not adm.local_split:
            # split among this release's replicas (those agreeing with it), not the other release's
            ours = [r for r in self.live if r == self.me or fields.get(r) == mine]
            adm.share_local(with_expected(ours, self.cfg.expected_replicas), self.me, self.holdings)
            self.fallback_gauge.set(1)
            self._changed()

    def _changed(self) -> None:
        """Requests queued here may go now: the core decides, the shell flushes their answers."""
        self.core.shares_changed()
        self.on_change()

    def _minid(self) -> str:
        """Trim the stream by Redis's clock (the last entry's id), not this replica's."""
        ms = int(self.last_id.split("-")[0]) if self.last_id and self.last_id != "0-0" else 0
        return f"{max(0, ms - EVENTS_KEEP_MS)}-0"

    def _apply(self, results: list[Any], calls: list[tuple[str, str, str]],
               forward: list[Forward], rejoining: bool, t0: float) -> bool:
        adm = self.core.admission
        if isinstance(results[0], BaseException):
            if isinstance(results[0], NoScriptError):
                self._sha.clear()  # Redis restarted: load them again
            self._forward[:0] = forward
            self._forget_heirs()  # (the slots calls after it may have failed too: all again next time)
            self._failed(results[0])
            return False
        self.sync_seconds.observe(time.perf_counter() - t0)
        self._hello_result(results[0])
        head = len(results) - len(calls)  # hello, the config's HSET, HGETALL, PEXPIRE and maybe HDEL
        was_conflict = self.conflict
        if not isinstance(results[2], BaseException):
            self._check_config(results[2])
        if rejoining and not (was_conflict or self.conflict):
            self._rejoin()  # (back from a conflict: at the next sync, whose hello starts a learning period)
        remote: list[Remote] = []
        ends = iter(forward)
        for (kind, tenant, dim), res in zip(calls, results[head:], strict=True):
            end = next(ends) if kind == "end" else None
            if isinstance(res, BaseException):
                # this call failed on its own (the others went through): a batch of events goes again,
                # an orphaned slot is given back next time, the rest is asked again at the next sync
                self.errors.labels(kind).inc()
                if kind == "slots":
                    self._forget_heirs(tenant)  # (written again at the next sync)
                if isinstance(res, NoScriptError):
                    self._sha.clear()
                else:
                    log.warning("store_call_failed", call=kind, tenant=tenant, error=str(res))
                if end is not None:
                    self._forward.append(end)
                continue
            if kind == "slots":
                self._slots_result(tenant, res)
            elif kind == "bucket":
                if len(res) == 2:
                    adm.share_credit(tenant, dim, float(res[0]), float(res[1]))
            elif kind == "end" and int(res) > 0:
                self.forwarded.labels("sent" if int(res) == 1 else "orphan").inc()
            elif kind == "xadd":
                self._batch = None
            elif kind == "last":
                self.last_id = _str(res[0][0]) if res else "0-0"
            elif kind == "read":
                remote[:0] = self._events(res)
            elif kind == "inbox":
                remote.extend(self._inbox(res))
        self._ok()
        for svc, disp, fwd, gone in remote:
            self.core.remote(svc, disp)
            for ev in fwd:
                self._deliver(ev)
            for envoy in gone:
                self.core.envoy_gone_elsewhere(envoy)
        self._changed()
        return True

    def _next_batch(self) -> bytes | None:
        """The events to send: the last batch again if it may not have arrived (readers skip a sequence
        they have seen), else what happened since. Bookings for nodes are only worth sending fresh."""
        adm = self.core.admission
        if self._batch is not None:
            adm.dispatch_out.clear()
            return self._batch
        service, adm.service_out = adm.service_out, {}
        dispatched, adm.dispatch_out = adm.dispatch_out, []
        if len(self._ends) > MAX_ENDS:
            self._drop_ends()
        ends, self._ends = self._ends[:ENDS_PER_BATCH], self._ends[ENDS_PER_BATCH:]
        gone = list(self.core.gone_out)  # an Envoy found gone here: every replica releases what it carried
        self.core.gone_out.clear()
        if not (service or dispatched or ends or gone):
            return None
        self._seq += 1
        doc: dict[str, Any] = {"r": self.me, "q": self._seq, "s": service, "d": dispatched, "e": ends}
        if gone:
            doc["g"] = gone
        self._batch = orjson.dumps(doc)
        return self._batch

    def _hello_result(self, res: list[Any]) -> None:
        epoch = _str(res[0])
        if self.epoch and epoch != self.epoch:
            log.warning("store_epoch_changed", note="the store lost its state (restarted empty): learning "
                        "period, slots rebuilt from what each replica holds", old=self.epoch, new=epoch)
            self.last_id = "0-0"  # a new stream: read it from its start
            self._versions.clear()
            self._seen.clear()
            self._forget_heirs()
        self.epoch = epoch
        self.learning = bool(int(res[1]))
        self.live = sorted({_str(r) for r in res[2]} | {self.me})
        self.replicas_gauge.set(len(self.live))
        uneven = res[3]
        holdings: dict[str, dict[str, int]] = {}
        for i in range(0, len(uneven) - 1, 2):
            raw = uneven[i + 1]
            fields = {_str(raw[j]): _str(raw[j + 1]) for j in range(0, len(raw) - 1, 2)}
            live = set(self.live)
            held = {f[2:]: int(v) for f, v in fields.items() if f.startswith("h:") and f[2:] in live}
            # a dead replica's slots, still taken by what it admitted (until a slots call orphans them):
            # what it last reported sent to a node (a:, else i:), never more than it held (as slots.lua orphans them)
            orphaned = sum(int(v) for f, v in fields.items() if f[:2] in ("o:", "p:")) + sum(
                min(int(v), int(fields.get(f"a:{f[2:]}", fields.get(f"i:{f[2:]}", v)))) for f, v in fields.items()
                if f.startswith("h:") and f[2:] not in live)
            if orphaned:
                held[ORPHANED] = orphaned
            holdings[_str(uneven[i])] = held
        self.holdings = holdings

    def _slots_result(self, tenant: str, res: list[Any]) -> bool:
        """Apply a slots answer; False when it was not applied (another epoch, another cap, or older
        than one already applied)."""
        asked = self._heirs_asked.pop(tenant, None)
        if int(res[0]) < 0:
            self._heirs_sent.pop(tenant, None)
            return False  # made for another epoch: the next sync asks again
        if asked is not None:
            self._heirs_sent[tenant] = asked  # the script wrote them
        s = self.core.admission.tenant_state(tenant)
        if s is None or s.config.max_concurrent != self._sent_cap.get(tenant):
            return False  # asked for another cap (a reload came in between): the next sync asks again
        held, free, version, orphans, given, running = (int(x) for x in res[:6])
        if version <= self._versions.get(tenant, 0):
            return False
        self._versions[tenant] = version
        if given:
            log.warning("store_taken_for_dead", tenant=tenant, slots_given_back=given,
                        note="this replica's heartbeat lapsed; completions of its requests freed their slots")
        rest = res[6:]
        holdings = {_str(rest[i]): int(rest[i + 1]) for i in range(0, len(rest) - 1, 2)}
        if orphans:
            holdings[ORPHANED] = orphans
        self.holdings[tenant] = holdings
        self.core.admission.share_slots(tenant, held, max(0, free), holdings.get(self.me, held), running)
        return True

    def _events(self, res: Any) -> list[Remote]:
        out: list[Remote] = []
        for _stream, entries in res or []:
            for eid, fields in entries:
                self.last_id = _str(eid)
                one = self._event(fields.get(b"b") if isinstance(fields, dict) else None, _str(eid))
                if one is not None:
                    out.append(one)
        return out

    def _inbox(self, res: Any) -> list[Remote]:
        """Completions forwarded to this replica, from its inbox: what a stream trimmed while this
        replica was cut off lost (a completion also read from the stream releases its lease once)."""
        out = [self._event(raw, "inbox") for raw in res or []]
        return [one for one in out if one is not None]

    def _event(self, raw: Any, eid: str) -> Remote | None:
        """One batch of another replica's events, or None (this replica's own, one seen, unreadable)."""
        try:
            doc = orjson.loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            return None
        if not isinstance(doc, dict) or doc.get("r") == self.me:
            return None
        sender, seq = str(doc.get("r")), doc.get("q")
        if isinstance(seq, int):
            if seq <= self._seen.get(sender, 0):
                return None  # sent again after a sync that failed: already applied
            self._seen[sender] = seq
        try:
            svc = {str(k): float(v) for k, v in (doc.get("s") or {}).items() if isinstance(v, int | float)}
            disp = [(str(d[0]), int(d[1]), int(d[2]), str(d[3])) for d in doc.get("d") or []
                    if isinstance(d, list) and len(d) == 4]
            fwd = [e for e in doc.get("e") or [] if isinstance(e, list) and len(e) == 8
                   and e[0] in (self.me, "*")]
            got = doc.get("u")
            parts = got if isinstance(got, list) and len(got) == 2 else None
            tail = doc.get("t")
            tail = tail if isinstance(tail, int | float) and not isinstance(tail, bool) else None
            if len(fwd) == 1 and (parts is not None or tail is not None):
                # (one forwarded completion: its cached and reasoning tokens, its client's tail)
                cached, reasoning = (int(parts[0]), int(parts[1])) if parts is not None else (0, 0)
                fwd = [[*fwd[0], cached, reasoning, float(tail) if tail is not None else 0.0]]
            gone = [str(g) for g in doc.get("g") or [] if isinstance(g, str)]
        except (TypeError, ValueError, IndexError, AttributeError):
            log.warning("store_event_unreadable", entry=eid)
            return None
        return svc, disp, fwd, gone

    def _deliver(self, e: list[Any]) -> None:
        try:
            owner, ticket, request_id, status, prompt, completion, answered, disconnected = e[:8]
            cached, reasoning = (int(e[8]), int(e[9])) if len(e) >= 10 else (0, 0)
            tail = float(e[10]) if len(e) >= 11 else 0.0
            usage = (Usage(int(prompt), int(completion), cached, reasoning)
                     if prompt is not None and completion is not None else None)
            done = self.core.ended(Ended(ticket or None, str(request_id), int(status), usage, bool(answered),
                                         bool(disconnected), tail_s=tail if math.isfinite(tail) else 0.0))
        except (TypeError, ValueError) as err:
            log.warning("forwarded_completion_unreadable", error=str(err))
            return
        if owner != "*" and done is not None:  # (read from the stream and the inbox: counted once)
            self.forwarded.labels("received").inc()

    def _drop_ends(self) -> None:
        """Bound what waits to be forwarded while Redis is away: the oldest go (their slots come back by
        reclaim at their owner, or by the lease timeout for a dead one)."""
        for queue in (self._ends, self._forward):
            if len(queue) > MAX_ENDS:
                dropped = len(queue) - MAX_ENDS
                del queue[:dropped]
                self.forwarded.labels("dropped").inc(dropped)

    def _ok(self) -> None:
        if not self.ok:
            log.info("store_up", replicas=len(self.live), epoch=self.epoch)
        self.ok = True
        # the store answers: its word is fresh again for every tenant (a borrow that failed before
        # must not turn a true 429 into a 503 for as long as the tenant does not borrow again)
        self.core.admission.leased.down = False
        self.core.admission.leased.unreached.clear()
        self._failing_since = None
        self.up_gauge.set(1)

    def _failed(self, e: BaseException) -> None:
        """Completions to forward are kept for the next try (the batch they are in goes again); credit
        given back in this sync is lost to the fleet, never spent twice."""
        adm = self.core.admission
        self.errors.labels("sync").inc()
        now = time.monotonic()
        if self._failing_since is None:
            # from when the failed sync began: a Redis that hangs has cost its whole timeout already
            self._failing_since = self._sync_started
            log.warning("store_unreachable", error=f"{type(e).__name__}: {e}", url=_safe(self.cfg.url))
        self.ok = False
        adm.leased.down = True  # its last word may be stale: a refusal now says nothing about the tenant
        self.up_gauge.set(0)
        self._drop_ends()
        if not adm.local_split and now - self._failing_since >= self.cfg.fallback_after_seconds:
            live = with_expected(self.live, self.cfg.expected_replicas)
            adm.share_local(live, self.me, self.holdings)
            self.fallback_gauge.set(1)
            log.error("store_down_local_split", replicas=len(live),
                      note="each limit split evenly among the replicas last seen alive until the store answers")
            self._changed()

    def _rejoin(self) -> None:
        """Back from a local split: leased credit again; what was spent meanwhile is debited (in the
        background: the next sync need not wait for it)."""
        adm = self.core.admission
        if not adm.local_split:
            return
        spent = adm.share_rejoin()
        self.fallback_gauge.set(0)
        log.info("store_rejoined", note="budgets are leased from the store again")
        if spent:
            task = asyncio.get_running_loop().create_task(self._debit(spent))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _debit(self, spent: dict[str, tuple[float, float]]) -> None:
        adm = self.core.admission
        if not self._sha:
            return
        pipe = self.client.pipeline(transaction=False)
        for tenant, dim, rate, capacity, amount in adm.leased.debits(spent):
            self._bucket_call(pipe, tenant, dim, rate, capacity, amount, partial=True)
        try:
            async with asyncio.timeout(2 * self.cfg.timeout_ms / 1000.0):
                await pipe.execute(raise_on_error=False)
        except (TimeoutError, RedisError, OSError):
            self.errors.labels("rejoin").inc()
        finally:
            await pipe.reset()

    # -- the request path ------------------------------------------------------------------------

    async def borrow(self, tenant: str, tokens: float, also: str | None = None) -> bool:
        """Before refusing: lease what this request lacks — a slot, a request, ``tokens`` — in one
        round trip, for ``tenant`` and, when its per-model budget is short here too, for ``also`` in
        the same round trip. Granted all or nothing per budget. False when refused or when the store could not
        be asked in time (``timeout_ms`` all told, waiting for a slots call before it included); in the
        second case the budget is marked *unreached* (``LeasedQuota.unreached``), so that the request is
        refused with 503 ``quota-unavailable`` and its Retry-After — not a 429 claiming the tenant is
        over a quota nobody could check — and never left to Envoy's timeout.

        Both budgets' answers are applied together, after the round trip, with no await between them
        and the caller's decision: a slot borrowed for one is never taken by another request while the
        other's answer is awaited (issue 29: two borrows gathered applied the first on its own)."""
        adm = self.core.admission
        unreached = adm.leased.unreached
        names = [tenant] if also is None else [tenant, also]
        interval = self.cfg.sync_interval_ms / 1000.0
        loop = asyncio.get_running_loop()
        budget = min(self.cfg.timeout_ms / 1000.0, BORROW_BUDGET_S)
        deadline = loop.time() + budget
        answered = False
        try:
            async with asyncio.timeout(budget):
                while True:
                    # (asked before the round trip: what this request lacked — a refused credit is the
                    # store's final word, worth no wait; only a slot can be idle at another replica)
                    short = [(s, adm.leased.needs(s, tokens)) for s in map(adm.tenant_state, names) if s is not None]
                    lacking = [(s, n) for s, n in short if n.slot is not None or n.credit]
                    slot_only = all(n.slot is not None and not n.credit for _, n in lacking)
                    granted, answered = await self._borrow(names, tokens)
                    idle = [s for s, _ in lacking if adm.leased.idle_elsewhere(s)]
                    if granted or not answered or not idle or not slot_only:
                        break
                    if loop.time() + interval > deadline - budget / 4:
                        break  # no time left to wait for a sync: refused (its 429 says slots idle elsewhere)
                    # every slot is held but not every slot is in use: an idle one moves to where the
                    # requests are within a sync or two (this replica's demand is reported meanwhile)
                    for s in idle:
                        adm.leased.wants_slot(s)
                    self.borrow_waits.inc()
                    await asyncio.sleep(interval)
        except (TimeoutError, RedisError, OSError):
            if answered:  # out of time while waiting for an idle slot to move: the store's answer stands
                self.borrows.labels("refused").inc()
                unreached.difference_update(names)
                return False
            self.errors.labels("borrow").inc()
            self.borrows.labels("error").inc()
            unreached.update(names)
            return False
        if answered:
            unreached.difference_update(names)
        else:
            unreached.update(names)
        return granted

    async def _borrow(self, names: list[str], tokens: float) -> tuple[bool, bool]:
        """(granted, whether the store answered every call): one pipeline for every budget in
        ``names``, its answers applied only once all are back."""
        adm = self.core.admission
        states = [s for s in map(adm.tenant_state, names) if s is not None]
        if not states:
            return False, True
        for s in states:
            if adm.leased.needs(s, tokens).slot is not None:
                while (ev := self._busy.get(s.name)) is not None:
                    await ev.wait()  # one slots call for a tenant at a time
        if adm.local_split or not self.ok or not self._sha:
            self.borrows.labels("refused").inc(len(states))
            return False, False
        needs = [(s, adm.leased.needs(s, tokens)) for s in states]
        claimed: list[str] = []
        answered = True
        try:
            for s, need in needs:
                if need.slot is not None:
                    if not self._claim(s.name):
                        return False, False
                    claimed.append(s.name)
            pipe = self.client.pipeline(transaction=False)
            calls: list[tuple[str, str, int]] = []
            for s, need in needs:
                if need.slot is not None:
                    n = need.slot
                    self._slots_call(pipe, s.name, n.cap, n.held, n.inflight, max(n.held, n.inflight) + 1, True,
                                     borrow=True, stays=n.stays)
                    calls.append((s.name, "slots", n.held))
                for dim, rate, capacity, amount in need.credit:
                    self._bucket_call(pipe, s.name, dim, rate, capacity, amount, partial=False)
                    calls.append((s.name, dim, 0))
            if not calls:
                await pipe.reset()
                return True, True
            try:
                results = await pipe.execute(raise_on_error=False)
            finally:
                await pipe.reset()
            # from here on no await: every answer applied, then the caller decides at once
            granted = dict.fromkeys((s.name for s in states), True)
            for (name, kind, held), res in zip(calls, results, strict=True):
                if isinstance(res, BaseException) or (kind != "slots" and len(res) != 2) or (
                        kind == "slots" and int(res[0]) < 0):
                    # not answered: an error, or a call made for another epoch (Redis restarted empty)
                    if isinstance(res, NoScriptError):
                        self._sha.clear()
                    if kind == "slots":
                        self._forget_heirs(name)
                    granted[name] = answered = False
                    continue
                if kind == "slots":
                    granted[name] &= self._slots_result(name, res) and int(res[0]) > held
                else:
                    granted[name] &= float(res[0]) > 0
                    adm.share_credit(name, kind, float(res[0]), float(res[1]))
        finally:
            self._done(claimed)
        for ok in granted.values():
            self.borrows.labels("granted" if ok else "refused").inc()
        return all(granted.values()), answered

    def forward(self, e: Ended, tenant: str = "", budget: str = "", stretched: bool = False) -> None:
        """A completion for a ticket another replica owns (the END script, at the next sync, hands it
        to its owner, or gives one of the owner's slots of ``tenant`` back if it died — for a request sent on
        the tenant's cap's stretch, ``stretched``, only if it took a slot over since: one of the owner's heirs),
        or, without a ticket, one this replica does not know (to every replica: Envoy gave up on a decision)."""
        u = e.usage
        event = [e.ticket.split("-", 1)[0] if e.ticket else "*", e.ticket or "", e.request_id, e.status,
                 u.prompt_tokens if u else None, u.completion_tokens if u else None, e.upstream_answered,
                 e.disconnected]
        if not e.ticket:
            self._ends.append(event)
            return
        owner = e.ticket.split("-", 1)[0]
        if self.core.admission.share_adopt(("" if stretched else tenant, budget), e.ticket):
            # the store is away: its owner learns of it only when the store answers; the slot is
            # taken over here meanwhile, so a tenant far under its cap is not refused by full splits
            self._changed()
        doc: dict[str, Any] = {"r": self.me, "e": [event]}
        if u is not None and (u.cached_tokens or u.reasoning_tokens):
            # spend budgets price cached prompt and reasoning tokens apart; a key of its own, which a
            # replica of an older version ignores (an event of another length it would drop)
            doc["u"] = [u.cached_tokens, u.reasoning_tokens]
        if e.tail_s > 0:
            doc["t"] = e.tail_s  # (the client's tail, ``Ended.tail_s``: a key of its own too)
        self._forward.append((owner, e.ticket, tenant or "-", budget, stretched, orjson.dumps(doc)))

    async def close(self) -> None:
        """A clean stop: leave at once (the others need not wait for its TTL), giving back every slot
        but those of requests sent to a node (what is still queued here ends with it)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            # per-model budgets' slices too: what still runs stays taken (orphaned) until its completion, which
            # another replica forwards, gives it back — for an heir, by the list of heirs; the rest goes back now
            for name, sent, heirs in self.core.admission.leased.held():
                pipe.hset(self._k_slots(name), mapping={f"h:{self.me}": sent, f"i:{self.me}": sent,
                                                       f"a:{self.me}": sent})
                pipe.delete(self._k_heirs(name, self.me))
                if heirs:
                    pipe.sadd(self._k_heirs(name, self.me), *heirs)
                    pipe.pexpire(self._k_heirs(name, self.me), self.orphan_ttl_ms + 60_000)
            pipe.zrem(self.k_replicas, self.me)
            async with asyncio.timeout(self.cfg.timeout_ms / 1000.0):
                await pipe.execute(raise_on_error=False)
        except (TimeoutError, RedisError, OSError):
            pass
        await self.client.aclose()


def _nothing() -> None:
    return None


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _safe(url: str) -> str:
    """The URL without its password (never logged)."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


__all__ = ["BUCKET", "END", "HELLO", "SCRIPTS", "SLOTS", "SharedStore"]
