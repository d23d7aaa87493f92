-- KEYS[1..] waiting_keys: queues' waiting sets (<queue>:waiting)
-- Returns Redis's time (ms), then per key
-- how many requests it holds and the lowest score (when the longest waiting of them began
-- to wait, Unix ms; '' when none waits).
local t = redis.call('TIME')
local out = {t[1] * 1000 + math.floor(t[2] / 1000)}
for _, key in ipairs(KEYS) do
  local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  out[#out + 1] = redis.call('ZCARD', key)
  out[#out + 1] = oldest[2] or ''
end
return out
