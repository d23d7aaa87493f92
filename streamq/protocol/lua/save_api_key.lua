-- KEYS: the api-keys hash (secret hash -> record), the api-key-names hash (name -> secret hash).
-- ARGV: the key's name, its secret's hash (create only), its record (JSON), 1 to create / 0 to update.
-- Creating refuses a name in use; updating replaces the record of an existing name, its
-- secret unchanged. Returns 1, or 0 when refused.
local old = redis.call('HGET', KEYS[2], ARGV[1])
if ARGV[4] == '1' then
  if old then
    return 0
  end
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
  return 1
end
if not old then
  return 0
end
redis.call('HSET', KEYS[1], old, ARGV[3])
return 1
