-- release: a worker gives back one slice, or all of its slices of one model (it leaves, or the
-- monitor reaped it).
-- KEYS[1] coverage hash (slice id -> workers holding it)
-- KEYS[2] workers hash  (worker id -> the slice ids it holds, sorted, joined by ",")
-- ARGV[1] worker id
-- ARGV[2] the slice id to give back ("" or absent: every slice it holds)
-- Returns the released slice ids joined by "," (sorted), or false when it held none of them.
heal(KEYS[1], KEYS[2])
local held = split(redis.call('HGET', KEYS[2], ARGV[1]))
local one = ARGV[2]
if one == '' then one = nil end
local gone, kept = {}, {}
for _, sid in ipairs(held) do
  if one == nil or sid == one then gone[#gone + 1] = sid else kept[#kept + 1] = sid end
end
if #gone == 0 then return false end
if #kept == 0 then redis.call('HDEL', KEYS[2], ARGV[1])
else redis.call('HSET', KEYS[2], ARGV[1], table.concat(kept, ',')) end
for _, sid in ipairs(gone) do
  local left = redis.call('HINCRBY', KEYS[1], sid, -1)
  if left <= 0 then redis.call('HDEL', KEYS[1], sid) end
end
return table.concat(gone, ',')
