-- A verbatim copy of streamq/protocol/lua/claim_jobs.lua as of commit 124a005 (before
-- priorities and tenants): the baseline bench/claim.py measures the new claim against.
-- KEYS[1]: the queue. ARGV: how many to claim, in-progress TTL (ms), queue entries to
-- read per page, the in-progress key prefix, this worker's id (the lease's holder).
-- Returns Redis's time (ms), then id, score, id, score, ... of the jobs claimed. Jobs
-- are due by Redis's clock, never a worker's. Running jobs stay in arq's queue until
-- they finish, so pages are read until enough free ones are found.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local wanted, page, claimed, offset = tonumber(ARGV[1]), tonumber(ARGV[3]), {now}, 0
while #claimed < 1 + 2 * wanted do
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', offset, page)
  if #due == 0 then break end
  for i = 1, #due, 2 do
    if redis.call('SET', ARGV[4] .. due[i], ARGV[5], 'NX', 'PX', ARGV[2]) then
      claimed[#claimed + 1] = due[i]
      claimed[#claimed + 1] = due[i + 1]
      if #claimed >= 1 + 2 * wanted then break end
    end
  end
  offset = offset + page
end
return claimed
