-- KEYS[1] api_keys_key: the api-keys hash (secret hash -> record)
-- KEYS[2] api_key_names_key: the api-key-names hash (name -> secret hash)
-- ARGV[1] name: the key's name
-- ARGV[2] secret_hash = '': its secret's hash (create only)
-- ARGV[3] record: its record (JSON)
-- ARGV[4] create: 1 to create, 0 to update
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
