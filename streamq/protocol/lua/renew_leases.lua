-- KEYS: in-progress keys. ARGV: ttl_ms, this worker's id, then per key the holder it
-- should name (<worker id>:<attempt>). A key naming this worker (its claim or the
-- attempt) is renewed; so is arq's own claim ('1', which names nobody: a worker run by
-- plain `arq`); a missing one (lapsed, nobody claimed it) is taken back; one that names
-- another holder is lost. Returns 1 (held) or 0 (lost) per key.
local ttl, me, held = ARGV[1], ARGV[2], {}
for i, key in ipairs(KEYS) do
  local holder, current = ARGV[i + 2], redis.call('GET', key)
  if current == false or current == me or current == holder or current == '1' then
    redis.call('SET', key, holder, 'PX', ttl)
    held[i] = 1
  else
    held[i] = 0
  end
end
return held
