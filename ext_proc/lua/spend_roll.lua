-- Spend budgets: a function the other spend_*.lua scripts call (prepended, as Redis scripts cannot import).
-- roll(account, window id, oldest live slot): move the account hash to the current window and return what
-- that window has spent. Calendar windows (oldest < 0): a new window id resets `spent`. Rolling windows:
-- charges sit in fields `s:<slot>`; slots older than `oldest` are dropped and the rest summed.
local function roll(key, win, oldest)
  if oldest < 0 then
    if redis.call('HGET', key, 'w') ~= win then
      redis.call('HSET', key, 'w', win, 'spent', '0')
    end
    return tonumber(redis.call('HGET', key, 'spent') or '0')
  end
  local sum = 0
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local f = all[i]
    if string.sub(f, 1, 2) == 's:' then
      if tonumber(string.sub(f, 3)) < oldest then
        redis.call('HDEL', key, f)
      else
        sum = sum + tonumber(all[i + 1])
      end
    end
  end
  return sum
end
