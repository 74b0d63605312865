-- retire: a worker gives back one slice only if that slice is covered beyond its target (K10,
-- an idle worker), or if it has another holder while some wanted slice has none (a full worker
-- makes room for coverage: coverage comes before second copies). Never uncovers a slice, so
-- two replicas of one slice cannot both leave.
-- KEYS[1] target hash   (slice id -> wanted replicas)
-- KEYS[2] coverage hash (slice id -> workers holding it)
-- KEYS[3] workers hash  (worker id -> the slice ids it holds, sorted, joined by ",")
-- ARGV[1] worker id
-- ARGV[2] slice id
-- Returns the released slice id, or false when the worker does not hold it or it is needed.
heal(KEYS[2], KEYS[3])
local held = split(redis.call('HGET', KEYS[3], ARGV[1]))
local kept, found = {}, false
for _, sid in ipairs(held) do
  if sid == ARGV[2] then found = true else kept[#kept + 1] = sid end
end
if not found then return false end
local want = tonumber(redis.call('HGET', KEYS[1], ARGV[2]) or '0') or 0
local cov = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0') or 0
local function some_uncovered()
  local target = redis.call('HGETALL', KEYS[1])
  for i = 1, #target, 2 do
    local held_by = tonumber(redis.call('HGET', KEYS[2], target[i]) or '0') or 0
    if (tonumber(target[i + 1]) or 0) > 0 and held_by <= 0 then
      return true
    end
  end
  return false
end
if cov <= want and not (cov >= 2 and some_uncovered()) then return false end
if #kept == 0 then redis.call('HDEL', KEYS[3], ARGV[1])
else redis.call('HSET', KEYS[3], ARGV[1], table.concat(kept, ',')) end
if cov - 1 <= 0 then redis.call('HDEL', KEYS[2], ARGV[2])
else redis.call('HINCRBY', KEYS[2], ARGV[2], -1) end
return ARGV[2]
