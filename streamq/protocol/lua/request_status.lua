-- KEYS[1] job_key: the job's key
-- KEYS[2] in_progress_key: its lease
-- KEYS[3] result_key: its result
-- KEYS[4] log_key: its replay log
-- KEYS[5] retry_key: its try count
-- KEYS[6] callback_key: its callback hash
-- KEYS[7..] queues = {}: queues to look in first
-- ARGV[1] request_id: the request's id
-- ARGV[2] models_key: the models hash (its queues are looked in next)
-- ARGV[3] in_progress_prefix: the in-progress keys' prefix
-- ARGV[4] ended = nil: where the log lives on a Redis Cluster, whether it holds a terminal
--   event ('1' or '0', read there just before; the log is not read here, and the caller
--   fills in `last` and `tokens`)
-- Only reads (run by EVALSHA_RO).
-- Returns a JSON object of what Redis holds about the request, on Redis's clock: `now`;
-- `last` (the log's newest event), `lease`, `tries`, `result` (arq's, its `s`, `r`, `st`,
-- `ft`, `q`), `callback` (the hash); while it has not ended: `queue`, `score`, `priority`,
-- `position` (its rank among the due requests of its priority waiting on that queue:
-- from `<queue>:waiting:<priority>` when the request is in it, else among the queue's
-- entries before it that no worker holds), `tokens` (token ids the log's chunks carry).
local id, prefix = ARGV[1], ARGV[3]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local out = {now = now}

local function field(flat, name)
  for i = 1, #flat, 2 do
    if flat[i] == name then return flat[i + 1] end
  end
  return nil
end

local ended = ARGV[4] == '1'
local last = {}
if ARGV[4] == nil then
  last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
end
if #last > 0 then
  out.last = field(last[1][2], 'event')
  local ok, event = pcall(cjson.decode, out.last or 'null')
  ended = ok and type(event) == 'table' and (event.type == 'final' or event.type == 'error')
end
local lease = redis.call('GET', KEYS[2])
if lease then out.lease = lease end
local tries = redis.call('GET', KEYS[5])
if tries then out.tries = tonumber(tries) end
local result = redis.call('GET', KEYS[3])
if result then
  local ok, r = pcall(cjson.decode, result)
  if ok and type(r) == 'table' then
    out.result = {s = r.s, r = r.r, st = r.st, ft = r.ft, q = r.q}
  else
    out.result = {s = false, r = 'an unreadable result'}
  end
end
local callback = redis.call('HGETALL', KEYS[6])
if #callback > 0 then
  local hash = {}
  for i = 1, #callback, 2 do hash[callback[i]] = callback[i + 1] end
  out.callback = hash
end
if ended or result then
  return cjson.encode(out)
end

local job = redis.call('GET', KEYS[1])
local priority = 0
if job then
  local ok, payload = pcall(cjson.decode, job)
  if ok and type(payload) == 'table' and type(payload.a) == 'table' and type(payload.a[1]) == 'table'
      and type(payload.a[1].priority) == 'number' then
    priority = payload.a[1].priority
  end
end
out.priority = priority
local queues = {unpack(KEYS, 7)}
for _, queue in ipairs(redis.call('HVALS', ARGV[2])) do queues[#queues + 1] = queue end
for _, queue in ipairs(queues) do
  local score = redis.call('ZSCORE', queue, id)
  if score then
    out.queue, out.score = queue, tonumber(score)
    break
  end
end
if out.queue and out.score <= now and not lease then
  local rank = redis.call('ZRANK', waiting_key(out.queue, string.format('%d', priority)), id)
  if rank then
    out.position = rank + 1
  else
    -- Running jobs stay in arq's queue: count the entries before this one nobody holds.
    local before, waiting, i = redis.call('ZRANK', out.queue, id), 0, 0
    while i < before do
      for _, other in ipairs(redis.call('ZRANGE', out.queue, i, math.min(i + 999, before - 1))) do
        if redis.call('EXISTS', prefix .. other) == 0 then waiting = waiting + 1 end
      end
      i = i + 1000
    end
    out.position = waiting + 1
  end
end
if #last > 0 then
  -- Tokens so far, page by page; a chunk's top-level "token_ids" is its first (text
  -- escapes its quotes, so it cannot spell the key).
  local tokens, from = 0, '-'
  while true do
    local page = redis.call('XRANGE', KEYS[4], from, '+', 'COUNT', 1000)
    for _, entry in ipairs(page) do
      local ids = string.match(field(entry[2], 'event') or '', '"token_ids":%[([^%]]*)%]')
      if ids then
        for _ in string.gmatch(ids, '[^,]+') do tokens = tokens + 1 end
      end
    end
    if #page < 1000 then break end
    from = '(' .. page[#page][1]
  end
  out.tokens = tokens
end
return cjson.encode(out)
