-- fair(demand, spare, cap): share.fair_slots in Lua (max-min fair whole slots by demand, the rounding's
-- leftovers to the largest unmet fractions, then one spare each, fewest first; ties by name). Not a
-- script on its own: store.py prepends it to slots.lua. tests/test_store.py checks the two agree.
local function fair(demand, spare, cap)
  cap = math.max(0, cap)
  local names = {}
  for r, _ in pairs(demand) do names[#names + 1] = r end
  table.sort(names, function(a, b)
    if demand[a] ~= demand[b] then return demand[a] < demand[b] end
    return a < b
  end)
  local left, share = cap, {}
  for i, r in ipairs(names) do
    local give = math.min(math.max(0, demand[r]), left / (#names - i + 1))
    share[r] = give
    left = left - give
  end
  local out, sum = {}, 0
  for _, r in ipairs(names) do out[r] = math.floor(share[r]); sum = sum + out[r] end
  left = cap - sum
  local byfrac = {}
  for _, r in ipairs(names) do byfrac[#byfrac + 1] = r end
  table.sort(byfrac, function(a, b)
    local fa, fb = share[a] - out[a], share[b] - out[b]
    if fa ~= fb then return fa > fb end
    return a < b
  end)
  for _, r in ipairs(byfrac) do
    if left <= 0 then break end
    if out[r] < demand[r] then out[r] = out[r] + 1; left = left - 1 end
  end
  local sp = {}
  for _, r in ipairs(names) do if spare[r] then sp[#sp + 1] = r end end
  table.sort(sp, function(a, b)
    if out[a] ~= out[b] then return out[a] < out[b] end
    return a < b
  end)
  for _, r in ipairs(sp) do
    if left <= 0 then break end
    out[r] = out[r] + 1; left = left - 1
  end
  return out
end
