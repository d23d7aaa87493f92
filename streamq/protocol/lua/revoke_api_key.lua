-- KEYS[1] api_keys_key: the api-keys hash
-- KEYS[2] api_key_names_key: the api-key-names hash
-- KEYS[3] window_key: the key's rate window
-- ARGV[1] name: the key's name
-- Deletes the key (gateways refuse its secret from their next request on) and its window.
-- Returns 1, or 0 for an unknown name.
local digest = redis.call('HGET', KEYS[2], ARGV[1])
if not digest then
  return 0
end
redis.call('HDEL', KEYS[1], digest)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
