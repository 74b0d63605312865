-- retire: an idle worker leaves only if its slice is covered beyond its target (K10), so that
-- two idle replicas of one slice cannot both leave and uncover it.
-- KEYS[1] target hash   (slice id -> wanted replicas)
-- KEYS[2] coverage hash (slice id -> workers holding it)
-- KEYS[3] workers hash  (worker id -> slice id)
-- ARGV[1] worker id
-- Returns the released slice id, or false when the worker is still needed.
local held = redis.call('HGET', KEYS[3], ARGV[1])
if not held then return false end
local want = tonumber(redis.call('HGET', KEYS[1], held) or '0') or 0
local cov = tonumber(redis.call('HGET', KEYS[2], held) or '0') or 0
if cov <= want then return false end
redis.call('HDEL', KEYS[3], ARGV[1])
if cov - 1 <= 0 then redis.call('HDEL', KEYS[2], held)
else redis.call('HINCRBY', KEYS[2], held, -1) end
return held
