-- KEYS[1] log_key: the request's log (the channel's name too)
-- KEYS[2] owner_key: the request's owner key
-- ARGV[1] event: the terminal event as JSON, without its seq
-- ARGV[2] maxlen: the log's length cap (MAXLEN ~)
-- ARGV[3] ttl_ms: how long the log, the owner key and the callback hash are kept
-- ARGV[4] callback_key = '': the request's callback hash ('' for none: on a Redis Cluster,
--   where the callback is left to the caller, its keys being on the control plane)
-- ARGV[5] callbacks_key: the callbacks set
-- ARGV[6] request_id: the request's id
-- ARGV[7] recent_ends_key: the recent-ends list ('' for none): the event is pushed there as
--   `<request_id> <ended_ms> <event JSON>`, ended_ms Redis's time
-- ARGV[8] recent_ends_max: the list's cap
-- ARGV[9] attempt = '': the attempt that ends it ('' for none)
-- ARGV[10] publish: the publish command (PUBLISH; SPUBLISH on a Redis Cluster); '' defers
--   (an end that waits for its replicas): nothing is published, and the reply is {seq,
--   payload}: the caller publishes the payload once its WAIT, on the same connection, answered
-- Logs and publishes the event with the next sequence number (and, for a final event, the
-- completion tokens the log holds), unless the request already ended; a callback stored at
-- enqueue is made due (as `schedule_callback` does). With an attempt (a worker ending its
-- own job that arq failed), nothing is written while a newer attempt owns the request.
-- Returns the seq given (deferred: {seq, payload}), -1 when it had already ended, -2 when a
-- newer attempt owns it.
-- The ended log, of at most 1,000 entries, is rewritten at its size (as append_and_publish
-- does: Redis allocates a stream's newest node at 4 KB for entries an ended log never gets).
local owner = redis.call('GET', KEYS[2])
if owner == 'ended' then
  return -1
end
if ARGV[9] ~= '' and owner and tonumber(owner) > tonumber(ARGV[9]) then
  return -2
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then
  seq = tonumber(string.match(last[1][1], '%-(%d+)$'))
end
local event = cjson.decode(ARGV[1])
event['seq'] = seq
if event['type'] == 'final' then
  -- Ended from outside the attempt that ran it: count the tokens its chunks carried.
  local tokens = 0
  for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
    local ok, logged = pcall(cjson.decode, entry[2][2])
    if ok and type(logged) == 'table' and logged['type'] == 'chunk' and type(logged['token_ids']) == 'table' then
      tokens = tokens + #logged['token_ids']
    end
  end
  event['completion_tokens'] = tokens
end
local payload = cjson.encode(event)
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '0-' .. (seq + 1), 'event', payload)
if ARGV[10] ~= '' then
  redis.call(ARGV[10], KEYS[1], payload)
end
if redis.call('XLEN', KEYS[1]) <= 1000 then
  redis.call('RESTORE', KEYS[1], 0, redis.call('DUMP', KEYS[1]), 'REPLACE')
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], 'ended', 'PX', ARGV[3])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if ARGV[7] ~= '' then
  redis.call('LPUSH', ARGV[7], ARGV[6] .. ' ' .. now .. ' ' .. payload)
  redis.call('LTRIM', ARGV[7], 0, tonumber(ARGV[8]) - 1)
end
local callback = ARGV[4]
if callback ~= '' and redis.call('HEXISTS', callback, 'spec') == 1 and redis.call('HEXISTS', callback, 'state') == 0 then
  redis.call('HSET', callback, 'state', 'pending', 'attempts', 0, 'ended_ms', now)
  redis.call('PEXPIRE', callback, ARGV[3])
  redis.call('ZADD', ARGV[5], now, ARGV[6])
end
if ARGV[10] == '' then
  return {seq, payload}
end
return seq
