-- release: a worker gives its slice back (it leaves, or the monitor reaped it).
-- KEYS[1] coverage hash (slice id -> workers holding it)
-- KEYS[2] workers hash  (worker id -> slice id)
-- ARGV[1] worker id
-- Returns the released slice id, or false when the worker held none.
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return false end
redis.call('HDEL', KEYS[2], ARGV[1])
local left = redis.call('HINCRBY', KEYS[1], held, -1)
if left <= 0 then redis.call('HDEL', KEYS[1], held) end
return held
