-- volunteer: give a worker a slice of one model that still has positive demand, that it does
-- not hold yet, and that fits in the memory the worker has left. Which one: coverage first (a
-- slice no worker holds, before any slice gets another copy), then the hottest (most token
-- rows routed to it, KEYS[5]), then the largest demand, the fewest holders, the smallest id.
-- KEYS[1] target hash   (slice id -> wanted replicas; written by the monitor)
-- KEYS[2] coverage hash (slice id -> workers holding it; written by this script and release)
-- KEYS[3] workers hash  (worker id -> the slice ids it holds, sorted, joined by ",")
-- KEYS[4] slices hash   (slice id -> JSON layout with "bytes"; written by the monitor)
-- KEYS[5] routed hash   (slice id -> token rows routed to it; coordinators count them)
-- ARGV[1] worker id
-- ARGV[2] bytes the worker can still hold ("" or absent: no limit); a slice with more is
--         never taken, so no reservation is wasted on a worker that cannot load it
-- ARGV[3] the slice ids of this model the worker knows it holds, joined by "," ("": none)
-- Returns the slice id, or false when no slice (that fits) has demand. Idempotent: a slice
-- listed for the worker that it does not know of (the answer to an earlier ask was lost) is
-- returned first, without counting it twice, if it fits `room`; one that does not fit is
-- given back (so a worker whose budget is full clears its lost answers by asking with room 0).
heal(KEYS[2], KEYS[3])
local room = tonumber(ARGV[2] or '')
local function fits(sid)
  if not room or not KEYS[4] then return true end
  local spec = redis.call('HGET', KEYS[4], sid)
  local size = spec and tonumber(cjson.decode(spec)['bytes']) or nil
  return size ~= nil and size <= room
end
local known, mine, held, lost, dropped = {}, {}, {}, false, false
for _, sid in ipairs(split(ARGV[3])) do known[sid] = true end
for _, sid in ipairs(split(redis.call('HGET', KEYS[3], ARGV[1]))) do
  if known[sid] or fits(sid) then
    if not known[sid] and not lost then lost = sid end
    held[#held + 1] = sid
    mine[sid] = true
  else
    dropped = true
    if redis.call('HINCRBY', KEYS[2], sid, -1) <= 0 then redis.call('HDEL', KEYS[2], sid) end
  end
end
if dropped then
  if #held == 0 then redis.call('HDEL', KEYS[3], ARGV[1])
  else redis.call('HSET', KEYS[3], ARGV[1], table.concat(held, ',')) end
end
if lost then return lost end
local target = redis.call('HGETALL', KEYS[1])
-- the best so far: {uncovered (1/0), rows routed, demand, -coverage}, larger wins, then sid
local best, key = false, nil
local function better(k, sid)
  if not best then return true end
  for i = 1, 4 do
    if k[i] ~= key[i] then return k[i] > key[i] end
  end
  return sid < best
end
for i = 1, #target, 2 do
  local sid = target[i]
  local want = tonumber(target[i + 1]) or 0
  local cov = tonumber(redis.call('HGET', KEYS[2], sid) or '0') or 0
  local demand = want - cov
  if mine[sid] then demand = 0 end
  if demand > 0 and not fits(sid) then demand = 0 end
  if demand > 0 then
    local rows = KEYS[5] and tonumber(redis.call('HGET', KEYS[5], sid) or '0') or 0
    local k = {cov == 0 and 1 or 0, rows, demand, -cov}
    if better(k, sid) then best, key = sid, k end
  end
end
if not best then return false end
held[#held + 1] = best
table.sort(held)
redis.call('HINCRBY', KEYS[2], best, 1)
redis.call('HSET', KEYS[3], ARGV[1], table.concat(held, ','))
return best
