-- Reserve a request's worst-case cost on every spend budget it counts against, or refuse it: the check
-- and the debit in one script, so replicas racing for the last dollar can never reserve more than the
-- limit together (Redis runs one script at a time).
-- KEYS: the accounts (one hash per tenant budget), then the replica's holds hash.
-- ARGV: ticket, then 5 per account: window id, oldest live slot (-1: calendar window), limit, need, mode.
-- Returns {1, shadow indexes that would have refused ("1,3"), what is left of each account after this
-- reservation ("0.25,3")} or {0, index of the refusing account, spent, reserved}. A ticket already held is answered {1, ""} again (a retried call reserves once).
local n = #KEYS - 1
local holds = KEYS[#KEYS]
if redis.call('HEXISTS', holds, ARGV[1]) == 1 then return {1, '', ''} end
local shadow = {}
local left = {}
for i = 1, n do
  local b = 1 + (i - 1) * 5
  local spent = roll(KEYS[i], ARGV[b + 1], tonumber(ARGV[b + 2]))
  local reserved = tonumber(redis.call('HGET', KEYS[i], 'reserved') or '0')
  left[i] = tostring(tonumber(ARGV[b + 3]) - spent - reserved - tonumber(ARGV[b + 4]))
  if spent + reserved + tonumber(ARGV[b + 4]) > tonumber(ARGV[b + 3]) + 1e-12 then
    if ARGV[b + 5] == 'hard' then
      return {0, i, tostring(spent), tostring(reserved)}
    elseif ARGV[b + 5] == 'shadow' then
      shadow[#shadow + 1] = tostring(i)
    end
  end
end
local parts = {}
for i = 1, n do
  local need = ARGV[1 + (i - 1) * 5 + 4]
  redis.call('HINCRBYFLOAT', KEYS[i], 'reserved', need)
  parts[i] = KEYS[i] .. '=' .. need
end
redis.call('HSET', holds, ARGV[1], table.concat(parts, ','))
return {1, table.concat(shadow, ','), table.concat(left, ',')}
