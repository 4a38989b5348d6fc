"""The store several kvgate replicas share: Redis (or Valkey), at the edge.

Nothing here decides anything: the arithmetic of slices is in ``share.py``, the decisions in
``admission.py``. This module moves state between the core and Redis, off the request path:

* **sync**, every ``sync_interval_ms``, one pipelined round trip: a heartbeat (the live replicas, the
  store's epoch), each active tenant's slots (wants → gets, max-min fair, by a Lua script so that the
  read-compute-write is atomic) and budget credit (leased from, or given back to, one bucket per tenant
  and budget, refilled in Redis by Redis's own clock), and the replica's events: fair-share service it
  gave, requests it sent to nodes, completions that reached it for tickets another replica owns —
  appended to one stream every replica reads;
* **borrow**, one round trip on the request path, only when a tenant's slice here cannot pay for a
  request and the fleet's may (``core.Borrow``): a 429 still means the tenant is over its quota
  fleet-wide, not over this replica's slice of it.

Failures: a sync that fails marks the store down (``kvgate_store_up`` 0); failing for
``fallback_after_seconds`` makes every replica enforce an even split of every limit among the replicas
it last saw alive (``Admission.share_local``). When Redis answers again the replica rejoins: its
budgets become leased credit again and what it spent meanwhile is debited; its slots are reported as
held, and the store keeps the larger of its record and what is in flight (no double counting). A Redis
that restarted empty has a new epoch: for one lease TTL (the *learning period*) no replica's slots grow
and buckets start empty, while each replica's report rebuilds the record of what it holds.

Keys share one hash tag (``{prefix}``) so the scripts work on a Redis Cluster too.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import orjson
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError

from . import logs
from .admission import ShareReport
from .config import RedisStore
from .core import Core, Ended
from .limits import Credit

log = logs.get("kvgate.store")

MAX_EVENTS = 20_000
"""Events kept in the stream (about two seconds of a busy fleet): a replica further behind skips ahead."""

# KEYS: replicas (zset replica -> expiry ms), epoch, learning, over (the tenants some replica holds more
# than an even split of). ARGV: replica, ttl ms, new epoch, known epoch, prefix of the slots hashes.
# Returns {epoch, learning 0|1, {live replica ids}, {tenant, {replica, held, ...}, ...}}: the holdings of
# the tenants held unevenly are what a fallback split must correct for (the others need no correction).
HELLO = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local e = redis.call('GET', KEYS[2])
if not e then
  e = ARGV[3]
  redis.call('SET', KEYS[2], e)
  if ARGV[4] ~= '' then redis.call('SET', KEYS[3], '1', 'PX', ttl) end
elseif ARGV[4] ~= '' and ARGV[4] ~= e then
  redis.call('SET', KEYS[3], '1', 'PX', ttl, 'NX')
end
local uneven = {}
for _, tenant in ipairs(redis.call('SRANDMEMBER', KEYS[4], 256)) do
  uneven[#uneven + 1] = tenant
  uneven[#uneven + 1] = redis.call('HGETALL', ARGV[5] .. tenant)
end
return {e, redis.call('EXISTS', KEYS[3]), redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf'), uneven}
"""

# KEYS: replicas, the tenant's slots hash (h:<replica> held, w:<replica> want), learning, over.
# ARGV: replica, cap, held here, in flight here, want, ttl ms, borrow 0|1, tenant.
# Returns {held, free, version, replica, held, replica, held, ...} (every live replica's holding).
SLOTS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local cap = tonumber(ARGV[2])
local inflight = tonumber(ARGV[4])
local want = tonumber(ARGV[5])
local live, n = {}, 0
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do live[r] = true; n = n + 1 end
if not live[me] then live[me] = true; n = n + 1 end
local held, wants = {}, {}
local raw = redis.call('HGETALL', KEYS[2])
for i = 1, #raw, 2 do
  local f, r, kind = raw[i], string.sub(raw[i], 3), string.sub(raw[i], 1, 2)
  if kind == 'h:' or kind == 'w:' then
    if not live[r] then
      redis.call('HDEL', KEYS[2], f)
    elseif kind == 'h:' then
      held[r] = tonumber(raw[i + 1])
    else
      wants[r] = tonumber(raw[i + 1])
    end
  end
end
-- no record: first sync, or the store restarted empty; rebuilt from what the replica holds
local mine = held[me] or tonumber(ARGV[3])
if mine < inflight then mine = inflight end
held[me] = nil
local others = 0
for _, h in pairs(held) do others = others + h end
wants[me] = want
local free = cap - others - mine
local target
if ARGV[7] == '1' then
  target = mine + math.max(0, math.min(want - mine, free))
else
  -- max-min fair share of cap by want (the same arithmetic as share.fair_slots)
  local names = {}
  for r, _ in pairs(wants) do names[#names + 1] = r end
  table.sort(names, function(a, b)
    if wants[a] ~= wants[b] then return wants[a] < wants[b] end
    return a < b
  end)
  local left, share = cap, {}
  for i, r in ipairs(names) do
    local give = math.min(math.max(0, wants[r]), left / (#names - i + 1))
    share[r] = give
    left = left - give
  end
  local whole, sum = {}, 0
  for _, r in ipairs(names) do whole[r] = math.floor(share[r]); sum = sum + whole[r] end
  local extra = cap - sum
  local byname = {}
  for _, r in ipairs(names) do byname[#byname + 1] = r end
  table.sort(byname)
  for _, r in ipairs(byname) do
    if extra <= 0 then break end
    if whole[r] < wants[r] then whole[r] = whole[r] + 1; extra = extra - 1 end
  end
  target = math.min(want, whole[me])
  if target > mine then
    target = mine + math.max(0, math.min(target - mine, free))
  else
    target = math.max(inflight, target)
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 and target > mine then target = mine end
redis.call('HSET', KEYS[2], 'h:' .. me, target, 'w:' .. me, want)
-- replies may come back out of order (a sync and a borrow on two connections): the replica keeps the newest
local version = redis.call('HINCRBY', KEYS[2], 'v', 1)
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[6]) * 20)
local even, uneven = math.floor(cap / n), target > math.floor(cap / n)
for _, h in pairs(held) do if h > even then uneven = true end end
if uneven then redis.call('SADD', KEYS[4], ARGV[8]) else redis.call('SREM', KEYS[4], ARGV[8]) end
local out = {target, cap - others - target, version, me, target}
for r, h in pairs(held) do out[#out + 1] = r; out[#out + 1] = h end
return out
"""

# KEYS: the bucket (hash l = level, t = when), learning. ARGV: rate per s, capacity, amount (+ lease,
# - give back), partial 0|1. Returns {granted, level} as strings (Lua numbers would be truncated).
BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, cap, amount = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local s = redis.call('HMGET', KEYS[1], 'l', 't')
local level, at = tonumber(s[1]), tonumber(s[2])
if level == nil then
  -- a new bucket starts full, except while the store relearns after losing its state: empty
  if redis.call('EXISTS', KEYS[2]) == 1 then level = 0 else level = cap end
  at = now
end
if now > at then level = math.min(cap, level + (now - at) * rate) end
local granted = 0
if amount > 0 then
  if ARGV[4] == '1' then granted = math.max(0, math.min(amount, level))
  elseif level >= amount then granted = amount end
  level = level - granted
else
  level = math.min(cap, level - amount)
end
redis.call('HSET', KEYS[1], 'l', level, 't', now)
redis.call('PEXPIRE', KEYS[1], math.floor(math.max(0, cap - level) / math.max(rate, 1e-9) * 1000) + 60000)
return {tostring(granted), tostring(level)}
"""


class SharedStore:
    """One replica's link to the store: its sync loop, its borrows, its forwarded completions."""

    def __init__(self, cfg: RedisStore, core: Core, registry: CollectorRegistry) -> None:
        self.cfg = cfg
        self.core = core
        self.me = core.admission.replica
        password = cfg.password_file.read_text().strip() if cfg.password_file is not None else None
        timeout = cfg.timeout_ms / 1000.0
        kw: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry_on_timeout": False}
        if password is not None:
            kw["password"] = password
        if cfg.tls_ca_file is not None:
            kw["ssl_ca_certs"] = str(cfg.tls_ca_file)
        self.client: Any = aioredis.Redis.from_url(cfg.url, **kw)
        self._hello = self.client.register_script(HELLO)
        self._slots = self.client.register_script(SLOTS)
        self._bucket = self.client.register_script(BUCKET)
        p = "{" + cfg.key_prefix + "}"
        self.k_replicas, self.k_epoch, self.k_learning, self.k_events, self.k_over = (
            f"{p}:replicas", f"{p}:epoch", f"{p}:learning", f"{p}:events", f"{p}:over")
        self._prefix = p
        self.epoch = ""
        self.live: list[str] = [self.me]
        self.holdings: dict[str, dict[str, int]] = {}
        """Tenant → replica → slots held, as last read: what a fallback split corrects for."""
        self.learning = False
        self._versions: dict[str, int] = {}
        """Tenant → the newest slots answer applied (answers to a sync and a borrow may cross)."""
        self._borrowing: dict[str, int] = {}
        """Tenant → borrows of a slot on their way: a burst on one replica asks for one slot each."""
        self.last_id: str | None = None
        self._ends: list[list[Any]] = []
        """Completions to forward: [owner ('*': every replica), ticket, request id, status, prompt,
        completion, upstream answered, disconnected]."""
        self._failing_since: float | None = None
        self.ok = False
        r = registry
        self.up_gauge = Gauge("kvgate_store_up", "1 while this replica's last sync with the shared store "
                              "succeeded; 0 while it fails (after store.redis.fallback_after_seconds each "
                              "replica enforces an even local split of every limit)", registry=r)
        self.replicas_gauge = Gauge("kvgate_store_replicas", "kvgate replicas alive as the store last said",
                                    registry=r)
        self.fallback_gauge = Gauge("kvgate_store_fallback", "1 while this replica enforces its local split "
                                    "of every limit because the store cannot be reached", registry=r)
        self.sync_seconds = Histogram("kvgate_store_sync_duration_seconds", "One sync with the shared store",
                                      buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                                      registry=r)
        self.borrows = Counter("kvgate_store_borrows_total", "Round trips to the store to borrow before "
                               "refusing a request, by result: granted | refused | error", ["result"], registry=r)
        self.errors = Counter("kvgate_store_errors_total", "Failed calls to the shared store", ["op"], registry=r)
        self.forwarded = Counter("kvgate_store_forwarded_completions_total", "Completions for tickets another "
                                 "replica owns: sent (forwarded to it) | received (from another)", ["direction"],
                                 registry=r)
        self.up_gauge.set(0)

    # -- keys ------------------------------------------------------------------------------------

    def _k_slots(self, tenant: str) -> str:
        return f"{self._prefix}:c:{tenant}"

    def _k_bucket(self, tenant: str, dim: str) -> str:
        return f"{self._prefix}:b:{tenant}:{dim}"

    # -- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        interval = self.cfg.sync_interval_ms / 1000.0
        while True:
            await self.sync()
            await asyncio.sleep(interval)

    async def sync(self) -> bool:
        """One round trip; True when it succeeded."""
        t0 = time.perf_counter()
        adm = self.core.admission
        interval = self.cfg.sync_interval_ms / 1000.0
        rejoining = adm.local_split > 0
        reports: list[ShareReport] = [] if rejoining else adm.share_report(len(self.live), interval)
        service, adm.service_out = adm.service_out, {}
        dispatched, adm.dispatch_out = adm.dispatch_out, []
        ends, self._ends = self._ends, []
        ttl_ms = int(self.cfg.lease_ttl_seconds * 1000)
        pipe = self.client.pipeline(transaction=False)
        await self._hello(keys=[self.k_replicas, self.k_epoch, self.k_learning, self.k_over],
                          args=[self.me, ttl_ms, secrets.token_hex(8), self.epoch, self._k_slots("")], client=pipe)
        calls: list[tuple[str, str, str]] = []
        for r in reports:
            if r.cap is not None and r.want is not None:
                await self._slots(keys=[self.k_replicas, self._k_slots(r.tenant), self.k_learning, self.k_over],
                                  args=[self.me, r.cap, r.slots, r.inflight, r.want, ttl_ms, 0, r.tenant], client=pipe)
                calls.append(("slots", r.tenant, ""))
            for dim, op in (("requests", r.requests), ("tokens", r.tokens)):
                if op is not None and op[2] != 0:
                    per_minute, capacity, amount = op
                    await self._bucket(keys=[self._k_bucket(r.tenant, dim), self.k_learning],
                                       args=[per_minute / 60.0, capacity, amount, 1], client=pipe)
                    calls.append(("bucket", r.tenant, dim))
        if service or dispatched or ends:
            batch = orjson.dumps({"r": self.me, "s": service, "d": dispatched, "e": ends})
            pipe.xadd(self.k_events, {"b": batch}, maxlen=MAX_EVENTS, approximate=True)
            calls.append(("xadd", "", ""))
        if self.last_id is None:
            pipe.xrevrange(self.k_events, count=1)
            calls.append(("last", "", ""))
        else:
            pipe.xread({self.k_events: self.last_id}, count=MAX_EVENTS)
            calls.append(("read", "", ""))
        try:
            results = await asyncio.wait_for(pipe.execute(), timeout=2 * self.cfg.timeout_ms / 1000.0)
        except (TimeoutError, RedisError, OSError) as e:
            self._failed(e, reports, service, dispatched, ends)
            return False
        finally:
            await pipe.reset()
        self.sync_seconds.observe(time.perf_counter() - t0)
        self._hello_result(results[0])
        if rejoining:
            await self._rejoin()
        remote: list[tuple[dict[str, float], list[tuple[str, int, int, str]], list[list[Any]]]] = []
        for (kind, tenant, dim), res in zip(calls, results[1:], strict=True):
            if kind == "slots":
                self._slots_result(tenant, res)
            elif kind == "bucket":
                adm.share_credit(tenant, dim, float(res[0]), float(res[1]))
            elif kind == "last":
                self.last_id = _id(res[0][0]) if res else "0-0"
            elif kind == "read":
                remote = self._events(res)
        self._ok()
        for svc, disp, fwd in remote:
            self.core.remote(svc, disp)
            for end in fwd:
                self._deliver(end)
        self.core.shares_changed()
        return True

    def _hello_result(self, res: list[Any]) -> None:
        epoch = _str(res[0])
        if self.epoch and epoch != self.epoch:
            log.warning("store_epoch_changed", note="the store lost its state (restarted empty): learning "
                        "period, slots rebuilt from what each replica holds", old=self.epoch, new=epoch)
            self.last_id = None
            self._versions.clear()
        self.epoch = epoch
        self.learning = bool(int(res[1]))
        self.live = sorted({_str(r) for r in res[2]} | {self.me})
        self.replicas_gauge.set(len(self.live))
        # what a fallback split corrects for: the tenants held unevenly (the rest need no correction)
        uneven = res[3]
        holdings: dict[str, dict[str, int]] = {}
        for i in range(0, len(uneven) - 1, 2):
            raw = uneven[i + 1]
            holdings[_str(uneven[i])] = {_str(raw[j])[2:]: int(raw[j + 1]) for j in range(0, len(raw) - 1, 2)
                                         if _str(raw[j]).startswith("h:")}
        self.holdings = holdings

    def _slots_result(self, tenant: str, res: list[Any]) -> None:
        held, free, version = int(res[0]), int(res[1]), int(res[2])
        if version <= self._versions.get(tenant, 0):
            return  # older than an answer already applied
        self._versions[tenant] = version
        rest = res[3:]
        self.holdings[tenant] = {_str(rest[i]): int(rest[i + 1]) for i in range(0, len(rest) - 1, 2)}
        self.core.admission.share_slots(tenant, held, max(0, free))

    def _events(self, res: Any) -> list[tuple[dict[str, float], list[tuple[str, int, int, str]], list[list[Any]]]]:
        out = []
        for _stream, entries in res or []:
            for eid, fields in entries:
                self.last_id = _id(eid)
                raw = fields.get(b"b") if isinstance(fields, dict) else None
                if raw is None:
                    continue
                try:
                    doc = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(doc, dict) or doc.get("r") == self.me:
                    continue
                svc = {str(k): float(v) for k, v in (doc.get("s") or {}).items() if isinstance(v, int | float)}
                disp = [(str(d[0]), int(d[1]), int(d[2]), str(d[3])) for d in doc.get("d") or []
                        if isinstance(d, list) and len(d) == 4]
                fwd = [e for e in doc.get("e") or [] if isinstance(e, list) and len(e) == 8
                       and e[0] in (self.me, "*")]
                out.append((svc, disp, fwd))
        return out

    def _deliver(self, e: list[Any]) -> None:
        owner, ticket, request_id, status, prompt, completion, answered, disconnected = e
        from .admission import Usage

        usage = Usage(int(prompt), int(completion)) if prompt is not None and completion is not None else None
        self.core.ended(Ended(ticket or None, str(request_id), int(status), usage, bool(answered), bool(disconnected)))
        if owner != "*":
            self.forwarded.labels("received").inc()

    def _ok(self) -> None:
        if not self.ok:
            log.info("store_up", replicas=len(self.live), epoch=self.epoch)
        self.ok = True
        self._failing_since = None
        self.up_gauge.set(1)

    def _failed(self, e: BaseException, reports: list[ShareReport], service: dict[str, float],
                dispatched: list[tuple[str, int, int, str]], ends: list[list[Any]]) -> None:
        """Keep what must not be lost for the next try (completions to forward, service and bookings);
        credit given back in this sync is lost to the fleet, never spent twice."""
        adm = self.core.admission
        for k, v in service.items():
            adm.service_out[k] = adm.service_out.get(k, 0.0) + v
        adm.dispatch_out[:0] = dispatched
        self._ends[:0] = ends
        self.errors.labels("sync").inc()
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
            log.warning("store_unreachable", error=f"{type(e).__name__}: {e}", url=_safe(self.cfg.url))
        self.ok = False
        self.up_gauge.set(0)
        if not adm.local_split and now - self._failing_since >= self.cfg.fallback_after_seconds:
            others = [r for r in self.live if r != self.me]
            adm.share_local(others, self.me, self.holdings)
            self.fallback_gauge.set(1)
            log.error("store_down_local_split", replicas=len(others) + 1,
                      note="each limit split evenly among the replicas last seen alive until the store answers")
            self.core.shares_changed()

    async def _rejoin(self) -> None:
        """Back from a local split: leased credit again; what was spent meanwhile is debited."""
        adm = self.core.admission
        adm.share_rejoin()
        spent, adm.fallback_spent = adm.fallback_spent, {}
        self.fallback_gauge.set(0)
        log.info("store_rejoined", note="budgets are leased from the store again")
        if not spent:
            return
        pipe = self.client.pipeline(transaction=False)
        for tenant, (requests, tokens) in spent.items():
            s = adm.tenant_state(tenant)
            if s is None:
                continue
            for dim, amount, b in (("requests", requests, s.requests), ("tokens", tokens, s.tokens)):
                if isinstance(b, Credit) and amount > 0:
                    await self._bucket(keys=[self._k_bucket(tenant, dim), self.k_learning],
                                       args=[b.rate, b.capacity, amount, 1], client=pipe)
        try:
            await asyncio.wait_for(pipe.execute(), timeout=2 * self.cfg.timeout_ms / 1000.0)
        except (TimeoutError, RedisError, OSError):
            self.errors.labels("rejoin").inc()
        finally:
            await pipe.reset()

    # -- the request path ------------------------------------------------------------------------

    async def borrow(self, tenant: str, tokens: float) -> bool:
        """Before refusing: lease what this request lacks — a slot, a request, ``tokens`` — in one
        round trip. Granted all or nothing per budget. False when the store could not be asked."""
        adm = self.core.admission
        s = adm.tenant_state(tenant)
        if s is None or adm.local_split or not self.ok:
            self.borrows.labels("refused" if s is not None else "error").inc()
            return False
        q = s.config
        pipe = self.client.pipeline(transaction=False)
        calls: list[str] = []
        ttl_ms = int(self.cfg.lease_ttl_seconds * 1000)
        held = s.slots or 0
        if q.max_concurrent is not None and s.inflight >= held:
            ahead = self._borrowing.get(tenant, 0)
            await self._slots(keys=[self.k_replicas, self._k_slots(tenant), self.k_learning, self.k_over],
                              args=[self.me, q.max_concurrent, held, s.inflight, max(held, s.inflight) + ahead + 1,
                                    ttl_ms, 1, tenant], client=pipe)
            calls.append("slots")
        for dim, b, need in (("requests", s.requests, 1.0), ("tokens", s.tokens, tokens)):
            if isinstance(b, Credit) and b.level < need:
                await self._bucket(keys=[self._k_bucket(tenant, dim), self.k_learning],
                                   args=[b.rate, b.capacity, need - b.level, 0], client=pipe)
                calls.append(dim)
        if not calls:
            await pipe.reset()
            return True
        slot = "slots" in calls
        if slot:
            self._borrowing[tenant] = self._borrowing.get(tenant, 0) + 1
        try:
            results = await asyncio.wait_for(pipe.execute(), timeout=self.cfg.timeout_ms / 1000.0)
        except (TimeoutError, RedisError, OSError):
            self.errors.labels("borrow").inc()
            self.borrows.labels("error").inc()
            return False
        finally:
            await pipe.reset()
            if slot:
                n = self._borrowing.get(tenant, 1) - 1
                if n > 0:
                    self._borrowing[tenant] = n
                else:
                    self._borrowing.pop(tenant, None)
        granted = True
        for kind, res in zip(calls, results, strict=True):
            if kind == "slots":
                granted &= int(res[0]) > held
                self._slots_result(tenant, res)
            else:
                granted &= float(res[0]) > 0
                adm.share_credit(tenant, kind, float(res[0]), float(res[1]))
        self.borrows.labels("granted" if granted else "refused").inc()
        return granted

    def forward(self, e: Ended) -> None:
        """A completion for a ticket another replica owns (or, without a ticket, one this replica does
        not know): sent to it with the next sync."""
        owner = e.ticket.split("-", 1)[0] if e.ticket else "*"
        u = e.usage
        self._ends.append([owner, e.ticket or "", e.request_id, e.status, u.prompt_tokens if u else None,
                           u.completion_tokens if u else None, e.upstream_answered, e.disconnected])
        if e.ticket:
            self.forwarded.labels("sent").inc()

    async def close(self) -> None:
        """Give back what this replica holds (a clean stop: the others need not wait for its TTL)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(self.k_replicas, self.me)
            await asyncio.wait_for(pipe.execute(), timeout=self.cfg.timeout_ms / 1000.0)
        except (TimeoutError, RedisError, OSError):
            pass
        await self.client.aclose()


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _id(v: Any) -> str:
    return _str(v)


def _safe(url: str) -> str:
    """The URL without its password (never logged)."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


__all__ = ["BUCKET", "HELLO", "SLOTS", "SharedStore"]
