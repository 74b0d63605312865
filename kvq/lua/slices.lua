-- slices: shared by the market's scripts (volunteer, release, retire, rejoin), which
-- `kvq.bus.scripts` loads with this file in front (EVAL scripts cannot import one another).
-- split: a workers-hash value (slice ids joined by ","; false when absent) -> a list.
local function split(text)
  local out = {}
  if text then for sid in string.gmatch(text, '[^,]+') do out[#out + 1] = sid end end
  return out
end
