-- KEYS: in-progress keys. ARGV: ttl_ms, this worker's id, its queue, then per key the
-- holder it should name (<worker id>:<attempt>) and the job id. A key naming this worker
-- (its claim or the attempt) is renewed; so is arq's own claim ('1', which names nobody: a
-- worker run by plain `arq`); a missing one (lapsed, nobody claimed it) is taken back while
-- the job is still in its queue; one that names another holder, or whose job has left the
-- queue (another attempt took it over and ended it), is lost. Returns 1 (held) or 0 (lost)
-- per key.
local ttl, me, queue, held = ARGV[1], ARGV[2], ARGV[3], {}
for i, key in ipairs(KEYS) do
  local holder, job = ARGV[2 * i + 2], ARGV[2 * i + 3]
  local current = redis.call('GET', key)
  if current == false and redis.call('ZSCORE', queue, job) == false then
    held[i] = 0
  elseif current == false or current == me or current == holder or current == '1' then
    redis.call('SET', key, holder, 'PX', ttl)
    held[i] = 1
  else
    held[i] = 0
  end
end
return held
