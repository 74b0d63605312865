-- attempt: start one run of a request, or find that another request entry owns its id.
-- KEYS[1] the request's run hash (fields: entry, attempts), expiring ARGV[2] s after each run
-- ARGV[1] the request stream entry id being started
-- ARGV[2] lifetime of the hash in seconds (the reply stream's)
-- Returns the run's number (1 for the first, 2 after a restart or takeover, ...), or 0 when
-- the id belongs to a different entry (a duplicate request id: the caller refuses it).
local owner = redis.call('HGET', KEYS[1], 'entry')
if owner and owner ~= ARGV[1] then
  return 0
end
if not owner then
  redis.call('HSET', KEYS[1], 'entry', ARGV[1])
end
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('EXPIRE', KEYS[1], ARGV[2])
return n
