-- KEYS: per event, its log/channel name and its owner key. ARGV: maxlen, ttl_ms, then
-- per event its entry id, attempt (0: not fenced), 1 if it is terminal (final/error) else
-- 0, and payload; then, optionally, the recent-ends list, its cap and the log keys' prefix:
-- each terminal event logged is pushed there as `<request_id> <ended_ms> <event JSON>`
-- (the request id is its log key without the prefix; ended_ms is Redis's time).
-- An event is skipped when its sequence number is already logged, when a newer attempt
-- owns the request (a worker that lost its lease but still runs must not
-- write over the one that took over), or when the request already ended. A terminal event
-- ends the request for everyone. Returns how many were skipped, then the request ids (their
-- log keys) whose events were refused because another attempt owns or ended it, each once.
-- Any error other than a duplicate id fails the whole call: the caller retries or fails
-- loudly, nothing is dropped in silence (events already written are skipped on retry).
local maxlen, ttl = ARGV[1], ARGV[2]
local skipped, touched, owners, superseded, last_seqs = 0, {}, {}, {}, {}
local tail = 2 + 2 * #KEYS
local recent_key, recent_max, prefix = ARGV[tail + 1], tonumber(ARGV[tail + 2]), ARGV[tail + 3]
local ended_ms, pushed = nil, false
for i = 1, #KEYS, 2 do
  local key, owner_key = KEYS[i], KEYS[i + 1]
  local base = 4 * (i - 1) / 2 + 2
  local id, attempt, terminal, payload = ARGV[base + 1], tonumber(ARGV[base + 2]), ARGV[base + 3], ARGV[base + 4]
  if owners[owner_key] == nil then
    owners[owner_key] = redis.call('GET', owner_key) or '0'
  end
  local owner = owners[owner_key]
  if owner == 'ended' or (attempt > 0 and attempt < tonumber(owner)) then
    skipped = skipped + 1
    if last_seqs[key] == nil then
      local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
      last_seqs[key] = #last > 0 and tonumber(string.match(last[1][1], '%-(%d+)$')) or 0
    end
    if tonumber(string.match(id, '%-(%d+)$')) > last_seqs[key] then
      superseded[key] = true  -- a new event, not a retried one: its attempt must stop
    end
  else
    local added = redis.pcall('XADD', key, 'MAXLEN', '~', maxlen, id, 'event', payload)
    if type(added) == 'table' and added.err then
      if not string.find(added.err, 'equal or smaller', 1, true) then
        return redis.error_reply(added.err)
      end
      skipped = skipped + 1
    else
      redis.call('PUBLISH', key, payload)
      touched[key] = owner_key
      if terminal == '1' then
        owners[owner_key] = 'ended'
        if recent_key then
          if ended_ms == nil then
            local t = redis.call('TIME')
            ended_ms = t[1] * 1000 + math.floor(t[2] / 1000)
          end
          redis.call('LPUSH', recent_key, string.sub(key, #prefix + 1) .. ' ' .. ended_ms .. ' ' .. payload)
          pushed = true
        end
      elseif attempt > tonumber(owner) then
        owners[owner_key] = tostring(attempt)
      end
    end
  end
end
for key, owner_key in pairs(touched) do
  redis.call('PEXPIRE', key, ttl)
  redis.call('SET', owner_key, owners[owner_key], 'PX', ttl)
end
if pushed then
  redis.call('LTRIM', recent_key, 0, recent_max - 1)
end
local reply = {skipped}
for key in pairs(superseded) do
  reply[#reply + 1] = key
end
return reply
