-- KEYS[1] window_key: the key's rate window
-- KEYS[2] streams_key: its open streams
-- KEYS[3] usage_key: its usage totals
-- ARGV[1] stream_member: this request's member of the open streams
-- ARGV[2] model: the model it used
-- ARGV[3] prompt_tokens: its prompt tokens
-- ARGV[4] completion_tokens: its completion tokens
-- ARGV[5] window_ms: the rate window's length
-- ARGV[6] counted: 1 to count the request in the totals (0: a resumed stream, counted when it
--   began)
-- Closes the request's stream, charges its tokens to the key's current window (the tokens
-- per minute limit) and adds them to its usage totals by model.
redis.call('ZREM', KEYS[2], ARGV[1])
local prompt, completion = tonumber(ARGV[3]), tonumber(ARGV[4])
local spent = prompt + completion
if spent > 0 then
  local t = redis.call('TIME')
  local window_ms = tonumber(ARGV[5])
  local window = math.floor((t[1] * 1000 + math.floor(t[2] / 1000)) / window_ms)
  if tonumber(redis.call('HGET', KEYS[1], 'window')) == window then
    redis.call('HINCRBY', KEYS[1], 'tokens', spent)
  else
    redis.call('HSET', KEYS[1], 'window', window, 'requests', 0, 'tokens', spent)
  end
  redis.call('PEXPIRE', KEYS[1], 2 * window_ms)
end
if ARGV[6] == '1' then
  redis.call('HINCRBY', KEYS[3], 'requests:' .. ARGV[2], 1)
end
if prompt > 0 then
  redis.call('HINCRBY', KEYS[3], 'prompt_tokens:' .. ARGV[2], prompt)
end
if completion > 0 then
  redis.call('HINCRBY', KEYS[3], 'completion_tokens:' .. ARGV[2], completion)
end
return 1
