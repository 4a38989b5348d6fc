-- A completion that reached another replica than its owner's.
-- KEYS: replicas, events, the tenant's slots hash, the tickets already ended for dead replicas[, the
-- per-model budget's slots hash].
-- ARGV: the owner, its ticket, the completion (JSON), orphan ttl ms. For a live owner, an event it reads;
-- for a dead one, one of its slots back (once per ticket) — decided here, on the store's own view of who
-- is alive.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or 0)
if score >= now then
  redis.call('XADD', KEYS[2], 'MINID', '~', tostring(now - 30000), '*', 'b', ARGV[3])
  return 1
end
if redis.call('SADD', KEYS[4], ARGV[2]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[4]))
-- the owner may only have been taken for dead: if it comes back it ends the lease (and its next slots
-- call takes the slot given back here off what it holds)
redis.call('XADD', KEYS[2], 'MINID', '~', tostring(now - 30000), '*', 'b', ARGV[3])
-- the tenant's slots (KEYS[3]) and, for a request under a per-model budget, the budget's (KEYS[5])
local out = 3
for k = 3, #KEYS do
  if k ~= 4 then
    for _, kind in ipairs({'o:', 'h:'}) do
      local n = tonumber(redis.call('HGET', KEYS[k], kind .. ARGV[1]) or 0)
      if n > 0 then
        redis.call('HINCRBY', KEYS[k], kind .. ARGV[1], -1)
        out = 2
        break
      end
    end
  end
end
return out
