-- lease: take, renew or drop a lease that one of several processes holds (the active monitor).
-- KEYS[1] lease key (a string: the holder's id), expiring ARGV[2] ms after the last renewal
-- ARGV[1] holder id
-- ARGV[2] lease length in ms; "0" drops the lease if ARGV[1] holds it
-- Returns 1 if ARGV[1] holds the lease after the call, else 0.
local cur = redis.call('GET', KEYS[1])
if ARGV[2] == '0' then
  if cur == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return 0
end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
