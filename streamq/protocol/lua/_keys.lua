-- The names of a queue's keys, as streamq.protocol.names spells them (a test holds the two
-- to each other): every script's text begins with these (see scripts.py, script_text).
-- Not a script: nothing runs it alone.
local function waiting_key(q, prio) return q .. ':waiting:' .. prio end -- names.waiting_key
local function queue_waiting_key(q) return q .. ':waiting' end -- names.queue_waiting_key
local function running_key(q) return q .. ':running' end -- names.running_key
local function affinity_free_key(q, worker) return q .. ':free:' .. worker end -- names.affinity_free_key
local function affinity_worker_key(q, key) return q .. ':affinity:' .. key end -- names.affinity_worker_key
