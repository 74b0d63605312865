-- rejoin: a serving worker re-asserts its slices (after a reap it survived, or lost Redis data).
-- KEYS[1] coverage hash (slice id -> workers holding it)
-- KEYS[2] workers hash  (worker id -> the slice ids it holds, sorted, joined by ",")
-- ARGV[1] worker id
-- ARGV[2..] slice ids it serves or loads
-- Returns how many of them were missing and are now counted again (0: nothing changed).
-- no workers hash: Redis lost it, and what coverage is left counts workers nobody lists (each
-- rejoins, and is counted, again)
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('DEL', KEYS[1]) end
heal(KEYS[1], KEYS[2])
local held = split(redis.call('HGET', KEYS[2], ARGV[1]))
local mine = {}
for _, sid in ipairs(held) do mine[sid] = true end
local added = 0
for i = 2, #ARGV do
  local sid = ARGV[i]
  if sid ~= '' and not mine[sid] then
    mine[sid] = true
    held[#held + 1] = sid
    redis.call('HINCRBY', KEYS[1], sid, 1)
    added = added + 1
  end
end
if added > 0 then
  table.sort(held)
  redis.call('HSET', KEYS[2], ARGV[1], table.concat(held, ','))
end
return added
