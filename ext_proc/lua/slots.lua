-- One tenant's concurrency slots (fair.lua is prepended: ``fair`` is defined above this line).
-- KEYS: replicas, the tenant's slots hash (per replica h: held, w: demand, x: spare, i: in flight, a: what
-- stays taken if it dies — its requests sent to a node, and a borrow's request just admitted; per dead
-- replica o: its orphaned slots, e: their expiry), learning, over, epoch, version counter[, this replica's
-- heirs of the tenant: tickets sent on the cap's stretch that took a slot over since, which END gives back].
-- ARGV: 1 replica, 2 cap, 3 slots it enforces now, 4 in flight, 5 demand, 6 spare 0|1, 7 ttl ms,
--       8 borrow 0|1, 9 tenant, 10 known epoch, 11 orphan ttl ms, 12 of those in flight, the ones sent to a node
--       (absent: all of them), 13... its heirs' tickets (none: it has none; '=': as it last wrote them).
-- Returns {-1} for a call made for another epoch, else {slots, free, version, orphaned slots, slots of its
-- own given back while it was taken for dead, requests in flight fleet-wide (every live replica's last
-- report, this one's now, and the orphans), replica, record, replica, record, ...}.
if redis.call('GET', KEYS[5]) ~= ARGV[10] then return {-1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, cap = ARGV[1], tonumber(ARGV[2])
local enforced, inflight = tonumber(ARGV[3]), tonumber(ARGV[4])
local live, n = {}, 0
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do live[r] = true; n = n + 1 end
if not live[me] then live[me] = true; n = n + 1 end
local raw = redis.call('HGETALL', KEYS[2])
local fields = {}
for i = 1, #raw, 2 do fields[raw[i]] = raw[i + 1] end
local held, demand, spare, busy, orphans, given = {}, {}, {}, {}, 0, 0
-- first the orphans of replicas that died earlier: expired ones go; this replica's own (it was taken for
-- dead while it lived: a lapsed heartbeat) go too — less the slots END gave back for requests of its
-- that ended meanwhile (c: what was orphaned, o: what is left), which it no longer holds
for f, v in pairs(fields) do
  local kind, r = string.sub(f, 1, 2), string.sub(f, 3)
  if kind == 'o:' then
    if r == me then
      given = math.max(0, tonumber(fields['c:' .. r] or v) - tonumber(v))
      redis.call('HDEL', KEYS[2], f, 'e:' .. r, 'c:' .. r)
    elseif tonumber(fields['e:' .. r] or 0) < now or tonumber(v) <= 0 then
      redis.call('HDEL', KEYS[2], f, 'e:' .. r, 'c:' .. r)
    else
      orphans = orphans + tonumber(v)
    end
  end
end
enforced = math.max(0, enforced - given)
local stays = math.max(0, math.min(inflight, tonumber(ARGV[12] or ARGV[4])) - given)
inflight = math.max(0, inflight - given)
-- then the replicas that died since: the requests they admitted still run and stay taken until
-- completions come in for them (END) or the lease timeout passes — what they last reported in flight
-- (a:, else i:), never more than they held; their idle spares come back now
for f, v in pairs(fields) do
  local kind, r = string.sub(f, 1, 2), string.sub(f, 3)
  if kind == 'h:' or kind == 'w:' or kind == 'x:' or kind == 'i:' or kind == 'a:' then
    if not live[r] then
      local taken = math.min(tonumber(v), tonumber(fields['a:' .. r] or fields['i:' .. r] or v))
      if kind == 'h:' and taken > 0 then
        redis.call('HINCRBY', KEYS[2], 'o:' .. r, taken)
        redis.call('HINCRBY', KEYS[2], 'c:' .. r, taken)
        redis.call('HSET', KEYS[2], 'e:' .. r, now + tonumber(ARGV[11]))
        orphans = orphans + taken
      end
      redis.call('HDEL', KEYS[2], f)
    elseif kind == 'h:' then
      held[r] = tonumber(v)
    elseif kind == 'w:' then
      demand[r] = tonumber(v)
    elseif kind == 'x:' then
      spare[r] = (v == '1')
    elseif kind == 'i:' and r ~= me then
      busy[r] = tonumber(v)
    end
  end
end
-- no record: first call, or the store restarted empty: rebuilt from what the replica enforces
local mine = held[me] or enforced
if mine < inflight then mine = inflight end
held[me] = nil
local others = orphans
for _, h in pairs(held) do others = others + h end
demand[me] = tonumber(ARGV[5])
spare[me] = (ARGV[6] == '1')
local free = cap - others - mine
local target
if ARGV[8] == '1' then
  -- a borrow adds to what the replica enforces, not to a record still above it (a share it was told to
  -- give back); only slots nobody holds
  local base = math.max(enforced, inflight)
  target = base + math.max(0, math.min(demand[me] - base, free))
else
  target = fair(demand, spare, cap - orphans)[me]
  if target > mine then
    target = mine + math.max(0, math.min(target - mine, free))
  else
    target = math.max(inflight, target)
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 and target > mine then target = mine end
-- never below what the replica admits on until it says it lowered it
local record = math.max(target, enforced, inflight)
-- a: what stays taken if this replica dies — sent to a node (ARGV[12]: what is queued dies with it, no completion
-- ever names it), and a borrow granted is for a request admitted
-- at once, before the replica's next report (i: stays what it reported: the fleet's running count)
local admitted = stays
if ARGV[8] == '1' and target > math.max(enforced, inflight) then admitted = stays + 1 end
redis.call('HSET', KEYS[2], 'h:' .. me, record, 'w:' .. me, demand[me], 'x:' .. me, ARGV[6], 'i:' .. me, inflight,
           'a:' .. me, admitted)
local keep = math.max(tonumber(ARGV[7]) * 20, tonumber(ARGV[11]) + 60000)
redis.call('PEXPIRE', KEYS[2], keep)
if KEYS[7] and ARGV[13] == '=' then
  redis.call('PEXPIRE', KEYS[7], keep)  -- as the replica last wrote them
elseif KEYS[7] then
  redis.call('DEL', KEYS[7])
  if #ARGV > 12 then
    for i = 13, #ARGV, 1000 do redis.call('SADD', KEYS[7], unpack(ARGV, i, math.min(i + 999, #ARGV))) end
    redis.call('PEXPIRE', KEYS[7], keep)
  end
end
local version = redis.call('INCR', KEYS[6])
local even = math.floor(cap / n)
local uneven = record > even or orphans > 0
for _, h in pairs(held) do if h > even then uneven = true end end
if uneven then redis.call('SADD', KEYS[4], ARGV[9]) else redis.call('SREM', KEYS[4], ARGV[9]) end
local running = orphans + inflight
for _, i in pairs(busy) do running = running + i end
local out = {target, cap - others - record, version, orphans, given, running, me, record}
for r, h in pairs(held) do out[#out + 1] = r; out[#out + 1] = h end
return out
