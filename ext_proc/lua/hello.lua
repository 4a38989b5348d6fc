-- The heartbeat, once per sync.
-- KEYS: replicas (zset replica -> expiry ms), epoch, learning, over (the tenants held unevenly).
-- ARGV: replica, ttl ms, new epoch, known epoch, prefix of the slots hashes, rejoining 0|1.
-- Returns {epoch, learning 0|1, {live replica ids}, {tenant, {field, value, ...}, ...}}: the holdings of
-- the tenants held unevenly are what a fallback split corrects for (the others need no correction).
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
if ARGV[6] == '1' then
  -- a replica back from its local split: what it holds is not on record yet
  redis.call('SET', KEYS[3], '1', 'PX', ttl)
end
local uneven = {}
for _, tenant in ipairs(redis.call('SRANDMEMBER', KEYS[4], 256)) do
  uneven[#uneven + 1] = tenant
  uneven[#uneven + 1] = redis.call('HGETALL', ARGV[5] .. tenant)
end
return {e, redis.call('EXISTS', KEYS[3]), redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf'), uneven}
