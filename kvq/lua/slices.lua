-- slices: shared by the market's scripts (volunteer, release, retire, rejoin), which
-- `kvq.bus.scripts` loads with this file in front (EVAL scripts cannot import one another).
-- split: a workers-hash value (slice ids joined by ","; false when absent) -> a list.
local function split(text)
  local out = {}
  if text then for sid in string.gmatch(text, '[^,]+') do out[#out + 1] = sid end end
  return out
end
-- heal: the coverage hash counts the workers that the workers hash lists, and the scripts keep
-- both present or both absent. When Redis lost one of them (a DEL, a restart without
-- persistence), make coverage agree with the workers hash again before any change: without
-- workers it counts nobody; without coverage it is counted again from the workers hash.
local function heal(cov, workers)
  local has_w = redis.call('EXISTS', workers) == 1
  local has_c = redis.call('EXISTS', cov) == 1
  if has_c and not has_w then redis.call('DEL', cov) end
  if has_w and not has_c then
    local flat = redis.call('HGETALL', workers)
    for i = 2, #flat, 2 do
      for _, sid in ipairs(split(flat[i])) do redis.call('HINCRBY', cov, sid, 1) end
    end
  end
end
