-- Settle a reservation exactly once: its worst case leaves `reserved`, its real cost is charged to the
-- window current now, and to the durable per-day record (tenant|model -> cost).
-- KEYS: the holds hash that has the ticket, the accounts (in the order they were reserved), the day record.
-- ARGV: ticket, then 4 per account: window id, oldest live slot (-1: calendar), this slot, charge ("held": the
-- reservation itself, for a request whose usage is not known); then the
-- day record's field and the request's cost for it ("" and 0: not recorded).
-- Returns 1, or 0 for a ticket that is not held (unknown, or already settled: nothing changes).
local payload = redis.call('HGET', KEYS[1], ARGV[1])
if not payload then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local amounts = {}
for pair in string.gmatch(payload, '[^,]+') do
  local eq = string.find(pair, '=', 1, true)
  amounts[string.sub(pair, 1, eq - 1)] = string.sub(pair, eq + 1)
end
local n = #KEYS - 2
for i = 1, n do
  local key = KEYS[i + 1]
  local b = 1 + (i - 1) * 4
  local held = amounts[key]
  if held then
    redis.call('HINCRBYFLOAT', key, 'reserved', -tonumber(held))
    local oldest = tonumber(ARGV[b + 2])
    roll(key, ARGV[b + 1], oldest)
    local charge = ARGV[b + 4]
    if charge == 'held' then charge = held end
    if tonumber(charge) > 0 then
      if oldest < 0 then
        redis.call('HINCRBYFLOAT', key, 'spent', charge)
      else
        redis.call('HINCRBYFLOAT', key, 's:' .. ARGV[b + 3], charge)
      end
      redis.call('HINCRBYFLOAT', key, 'total', charge)
    end
  end
end
local field, day = ARGV[#ARGV - 1], ARGV[#ARGV]
if field ~= '' and tonumber(day) > 0 then
  redis.call('HINCRBYFLOAT', KEYS[#KEYS], field, day)
end
return 1
