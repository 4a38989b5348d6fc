-- A completion that reached another replica than its owner's.
-- KEYS: replicas, events, the tenant's slots hash, the tickets already ended for dead replicas, the
-- owner's inbox, the owner's heirs of the tenant (slots.lua)[, the per-model budget's slots hash].
-- ARGV: the owner, its ticket, the completion (JSON), orphan ttl ms, 1 if it was sent on its tenant's cap's
-- stretch (it holds the tenant's slot only if it took one over since: it is among the owner's heirs). For a
-- live owner, an event it reads; for a dead one, one of its slots back (once per ticket) — decided here, on
-- the store's own view of who is alive. The event goes to the stream (trimmed after 30 s) and to the owner's
-- inbox, which it empties at each sync: an owner cut off for longer still gets it (until the orphan ttl; once
-- per ticket).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or 0)
local function deliver()
  redis.call('XADD', KEYS[2], 'MINID', '~', tostring(now - 30000), '*', 'b', ARGV[3])
  redis.call('RPUSH', KEYS[5], ARGV[3])
  redis.call('PEXPIRE', KEYS[5], tonumber(ARGV[4]))
end
if score >= now then
  deliver()
  return 1
end
if redis.call('SADD', KEYS[4], ARGV[2]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[4]))
-- the owner may only have been taken for dead: if it comes back it ends the lease (and its next slots
-- call takes the slot given back here off what it holds)
deliver()
-- the tenant's slots (KEYS[3]) and, for a request under a per-model budget, the budget's (KEYS[7])
-- (not yet orphaned — no slots call since it died — h: and a: both: the call orphans the lesser, attack109 M2)
local out = 3
for k = 3, #KEYS do
  local holds = k ~= 4 and k ~= 5 and k ~= 6
  if k == 3 and ARGV[5] == '1' then holds = redis.call('SREM', KEYS[6], ARGV[2]) == 1 end
  if holds then
    for _, kind in ipairs({'o:', 'h:'}) do
      local n = tonumber(redis.call('HGET', KEYS[k], kind .. ARGV[1]) or 0)
      if n > 0 then
        redis.call('HINCRBY', KEYS[k], kind .. ARGV[1], -1)
        if kind == 'h:' and tonumber(redis.call('HGET', KEYS[k], 'a:' .. ARGV[1]) or 0) > 0 then
          redis.call('HINCRBY', KEYS[k], 'a:' .. ARGV[1], -1)
        end
        out = 2
        break
      end
    end
  end
end
return out
