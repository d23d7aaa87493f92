-- KEYS[1..] events{log_key, owner_key}: per event, its request's log (the channel's name
--   too) and owner key
-- ARGV[1] maxlen: the logs' length cap (MAXLEN ~)
-- ARGV[2] ttl_ms: how long a log and its owner key outlive their last event
-- ARGV[3..] events{entry_id, attempt, terminal, payload}: per event, its entry id
--   (0-<seq + 1>), its attempt (0: not fenced), 1 if it is terminal (final/error) else 0,
--   and its JSON
-- ARGV[n+1] recent_ends_key = nil: the recent-ends list: each terminal event logged is
--   pushed there as `<request_id> <ended_ms> <event JSON>` (ended_ms Redis's time); nil: none
-- ARGV[n+2] recent_ends_max = nil: the list's cap
-- ARGV[n+3] log_prefix = nil: the log keys' prefix (a log key without it is its request id)
-- ARGV[n+4] publish = nil: the publish command: PUBLISH when nil; SPUBLISH on a Redis
--   Cluster, where the keys and the list share one slot; '' defers (an end that waits for
--   its replicas): nothing is published, every key named is written again (so that the
--   connection has written something a WAIT after the call covers, even when every event
--   was a duplicate), and the reply says which events the caller publishes after its WAIT
-- An event is logged and published only as the next entry of its request's log. Otherwise:
-- - its entry already holds this very payload: a duplicate (a retried batch), skipped;
-- - its entry holds another payload, a newer attempt owns the request, or the request
--   already ended: refused, and its request reported as superseded (that attempt stops);
-- - it would leave a gap (entries this attempt wrote are gone: a Redis that lost
--   acknowledged writes): refused, and its request reported out of step (that attempt hands
--   its job back; the next one goes on from what the log holds).
-- A terminal event ends the request for everyone. Returns {skipped, {log keys superseded},
-- {log keys out of step}}, each key once; deferred, a fourth: {positions (1, 2, ...) of the
-- events to publish}: those logged now and duplicates (their entry holds this very payload).
-- Any other error fails the whole call: the caller retries or fails loudly, nothing is
-- dropped in silence (events already written are duplicates on retry).
-- A log that ends here, of at most compact_max entries, is rewritten at its size (DUMP,
-- RESTORE): Redis allocates a stream's newest node at 4 KB (stream-node-max-bytes) for the
-- entries to come, and an ended log gets none; a short one would keep ten times its bytes.
local maxlen, ttl = ARGV[1], ARGV[2]
local compact_max = 1000
local skipped, touched, owners, lasts, superseded, out_of_step = 0, {}, {}, {}, {}, {}
local tail = 2 + 2 * #KEYS
local recent_key, recent_max, prefix = ARGV[tail + 1], tonumber(ARGV[tail + 2]), ARGV[tail + 3]
local publish = ARGV[tail + 4] or 'PUBLISH'
local defer = publish == ''
local named, existed, publishable, ended = {}, {}, {}, {}
local ended_ms, pushed = nil, false
for i = 1, #KEYS, 2 do
  local key, owner_key = KEYS[i], KEYS[i + 1]
  local base = 4 * (i - 1) / 2 + 2
  local id, attempt, terminal, payload = ARGV[base + 1], tonumber(ARGV[base + 2]), ARGV[base + 3], ARGV[base + 4]
  local entry = tonumber(string.match(id, '%-(%d+)$'))
  if owners[key] == nil then
    local owner = redis.call('GET', owner_key)
    owners[key], existed[key], named[key] = owner or '0', owner ~= false, owner_key
    -- Entries are 0-1, 0-2, ... with no gap, so an untrimmed log's last is its length (O(1));
    -- MAXLEN ~ trims only a log longer than maxlen.
    local length = redis.call('XLEN', key)
    if length < tonumber(maxlen) then
      lasts[key] = length
    else
      local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
      lasts[key] = tonumber(string.match(last[1][1], '%-(%d+)$'))
    end
  end
  local owner = owners[key]
  if entry <= lasts[key] then
    skipped = skipped + 1
    local logged = redis.call('XRANGE', key, id, id)
    if #logged > 0 and logged[1][2][2] ~= payload then
      superseded[key] = true -- another attempt wrote this entry
    elseif defer and #logged > 0 then
      publishable[#publishable + 1] = (i + 1) / 2 -- ours already: told again (a retry)
    end -- else ours already (or trimmed away by MAXLEN long ago)
  elseif owner == 'ended' or (attempt > 0 and attempt < tonumber(owner)) then
    skipped = skipped + 1
    superseded[key] = true
  elseif entry > lasts[key] + 1 then
    skipped = skipped + 1
    out_of_step[key] = true
  else
    redis.call('XADD', key, 'MAXLEN', '~', maxlen, id, 'event', payload)
    if defer then
      publishable[#publishable + 1] = (i + 1) / 2
    else
      redis.call(publish, key, payload)
    end
    lasts[key] = entry
    touched[key] = owner_key
    if terminal == '1' then
      owners[key] = 'ended'
      ended[key] = true
      if recent_key then
        if ended_ms == nil then
          local t = redis.call('TIME')
          ended_ms = t[1] * 1000 + math.floor(t[2] / 1000)
        end
        redis.call('LPUSH', recent_key, string.sub(key, #prefix + 1) .. ' ' .. ended_ms .. ' ' .. payload)
        pushed = true
      end
    elseif attempt > tonumber(owner) then
      owners[key] = tostring(attempt)
    end
  end
end
for key, owner_key in pairs(touched) do
  if ended[key] and redis.call('XLEN', key) <= compact_max then
    redis.call('RESTORE', key, 0, redis.call('DUMP', key), 'REPLACE')
  end
  redis.call('PEXPIRE', key, ttl)
  redis.call('SET', owner_key, owners[key], 'PX', ttl)
end
if defer then
  for key, owner_key in pairs(named) do
    if not touched[key] then
      redis.call('PEXPIRE', key, ttl)
      if existed[key] then
        redis.call('SET', owner_key, owners[key], 'PX', ttl)
      end
    end
  end
end
if pushed then
  redis.call('LTRIM', recent_key, 0, recent_max - 1)
end
local refused, stepped = {}, {}
for key in pairs(superseded) do
  refused[#refused + 1] = key
end
for key in pairs(out_of_step) do
  if not superseded[key] then
    stepped[#stepped + 1] = key
  end
end
if defer then
  return {skipped, refused, stepped, publishable}
end
return {skipped, refused, stepped}
