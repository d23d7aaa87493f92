-- KEYS[1] queue: arq's queue
-- ARGV[1] worker_id: this worker's id
-- ARGV[2] wakeup_channel: where the other workers are woken
-- A worker that stops claiming gives back the jobs enqueue held for it, each to its place in
-- the index (see claim_jobs), and drops its free slots and load, so enqueue routes nothing
-- more to it; the other workers are woken to take what it gave back. Its
-- <queue>:affinity:<key> entries stay until they lapse: enqueue skips a worker without free
-- slots. A job only some workers may run (<queue>:eligible:<id>) is made due at once
-- instead, for the next claim to hold it for another of them. Returns how many jobs it
-- gave back.
local q, me = KEYS[1], ARGV[1]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local my_bands = q .. ':affine-bands:' .. me
local n = 0
for _, band in ipairs(redis.call('ZRANGE', my_bands, 0, -1)) do
  local mine = q .. ':affine:' .. me .. ':' .. band
  for _, id in ipairs(redis.call('ZRANGE', mine, 0, -1)) do
    redis.call('ZREM', q .. ':deferred', id) -- its window's end
    redis.call('HDEL', q .. ':held', id)
    local meta = redis.call('HGET', q .. ':indexed', id)
    local score = redis.call('ZSCORE', waiting_key(q, band), id)
    if meta and score and redis.call('EXISTS', q .. ':eligible:' .. id) == 1 then
      redis.call('ZADD', q .. ':deferred', now, id)
      n = n + 1
    elseif meta and score then
      local tenant = string.match(meta, '^%S+ (%S+)')
      redis.call('ZADD', q .. ':fifo:' .. band .. ':' .. tenant, score, id)
      redis.call('ZADD', q .. ':tenants:' .. band, 'NX', 0, tenant)
      redis.call('ZADD', q .. ':bands', band, band)
      n = n + 1
    end
  end
  redis.call('DEL', mine)
end
redis.call('DEL', my_bands, affinity_free_key(q, me))
redis.call('ZREM', q .. ':load', me)
if n > 0 then
  redis.call('PUBLISH', ARGV[2], q)
end
return n
