-- slices: shared by the market's scripts (volunteer, release, retire, rejoin), which
-- `kvq.bus.scripts` loads with this file in front (EVAL scripts cannot import one another).
-- split: a workers-hash value (slice ids joined by ","; false when absent) -> a list.
local function split(text)
  local out = {}
  if text then for sid in string.gmatch(text, '[^,]+') do out[#out + 1] = sid end end
  return out
end
-- heal: the coverage hash counts the workers that the workers hash lists. When Redis lost the
-- coverage hash (a DEL, a restart without persistence) but not the workers hash, count it again
-- from the workers hash before any change (rejoin.lua also handles the other way round).
local function heal(cov, workers)
  if redis.call('EXISTS', cov) == 1 or redis.call('EXISTS', workers) == 0 then return end
  local flat = redis.call('HGETALL', workers)
  for i = 2, #flat, 2 do
    for _, sid in ipairs(split(flat[i])) do redis.call('HINCRBY', cov, sid, 1) end
  end
end
