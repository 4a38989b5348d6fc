-- One tenant's budget bucket (requests or tokens): lease credit from it or give credit back.
-- KEYS: the bucket (hash l = level, t = when), learning, epoch. ARGV: rate per s, capacity, amount
-- (+ lease, - give back), partial 0|1, known epoch. Returns {granted, level} as strings formatted with
-- %.17g (a Lua number returned as such is truncated to an integer; tostring keeps only 14 significant
-- digits, so 23 leased came back as 22.99999999999999 and did not pay for 23), or {'epoch'} for a call
-- made for another epoch.
if redis.call('GET', KEYS[3]) ~= ARGV[5] then return {'epoch'} end
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
local full_ms = math.max(0, cap - level) / math.max(rate, 1e-9) * 1000
redis.call('PEXPIRE', KEYS[1], math.floor(math.min(full_ms, 86400000)) + 60000)
return {string.format('%.17g', granted), string.format('%.17g', level)}
