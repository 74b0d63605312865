-- rejoin: a serving worker re-asserts its slice (after a reap it survived, or lost Redis data).
-- KEYS[1] coverage hash (slice id -> workers holding it)
-- KEYS[2] workers hash  (worker id -> slice id)
-- ARGV[1] worker id
-- ARGV[2] slice id
-- Returns 1 when the worker was missing and is now counted again, 0 when nothing changed.
local held = redis.call('HGET', KEYS[2], ARGV[1])
if held == ARGV[2] then return 0 end
if held then
  local left = redis.call('HINCRBY', KEYS[1], held, -1)
  if left <= 0 then redis.call('HDEL', KEYS[1], held) end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
return 1
