-- KEYS[1] window_key: the key's rate window (hash: window, requests, tokens)
-- KEYS[2] streams_key: the key's open streams (sorted set: member -> when its lease lapses)
-- ARGV[1] secret_hash: the hash of the key's secret (its field in the api-keys hash)
-- ARGV[2] model: the model asked for
-- ARGV[3] stream_member: this request's member of the open streams
-- ARGV[4] stream_lease_ms: how long the stream counts as open unless renewed
-- ARGV[5] window_ms: the rate window's length
-- ARGV[6] api_keys_key: the api-keys hash (only read: not in KEYS, which a caller must be
--   allowed to write)
-- One round trip per HTTP request: reads the key's record (so a revoked key or changed
-- limits apply at once on every gateway), checks its model allow-list, requests and tokens
-- in this window and open streams; if all pass, counts the request and opens its stream.
-- Returns {'ok', 0, 0} or {limit, retry_after_s, value} with limit one of 'revoked',
-- 'model', 'rpm', 'tpm', 'max_streams'. Limits absent from the record are no limits.
local raw = redis.call('HGET', ARGV[6], ARGV[1])
if not raw then
  return {'revoked', 0, 0}
end
local key = cjson.decode(raw)
if key.models then
  local allowed = false
  for _, model in ipairs(key.models) do
    if model == ARGV[2] then
      allowed = true
    end
  end
  if not allowed then
    return {'model', 0, 0}
  end
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local window_ms = tonumber(ARGV[5])
local window = math.floor(now / window_ms)
local retry_after = math.ceil(((window + 1) * window_ms - now) / 1000)
local current = redis.call('HMGET', KEYS[1], 'window', 'requests', 'tokens')
local requests, tokens = 0, 0
if tonumber(current[1]) == window then
  requests = tonumber(current[2]) or 0
  tokens = tonumber(current[3]) or 0
end
if key.rpm and requests >= key.rpm then
  return {'rpm', retry_after, key.rpm}
end
if key.tpm and tokens >= key.tpm then
  return {'tpm', retry_after, key.tpm}
end
local lease_ms = tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if key.max_streams and redis.call('ZCARD', KEYS[2]) >= key.max_streams then
  return {'max_streams', 1, key.max_streams}
end
redis.call('HSET', KEYS[1], 'window', window, 'requests', requests + 1, 'tokens', tokens)
redis.call('PEXPIRE', KEYS[1], 2 * window_ms)
redis.call('ZADD', KEYS[2], now + lease_ms, ARGV[3])
redis.call('PEXPIRE', KEYS[2], lease_ms)
return {'ok', 0, 0}
