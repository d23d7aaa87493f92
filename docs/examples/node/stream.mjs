// Enqueue a prompt on streamq and print its tokens as they come, with plain Redis commands
// (PROTOCOL.md is the contract):  npm install && node stream.mjs "The key to happiness is"
// Environment: REDIS_URL (redis://localhost:6379), STREAMQ_QUEUE (streamq:queue),
// STREAMQ_QUEUE_LIMIT (refuse when the queue holds this many jobs; -1, the default: no limit),
// STREAMQ_LUA_DIR (the folder holding enqueue.lua and _keys.lua; default: this repository's).
// Output: the text as it streams, then a last line `[<finish reasons, comma-separated>]
// <prompt tokens> <completion tokens>`, e.g. `[length] 6 16`; on stderr `queued <request id>`
// (for `streamq status`). An error event, a refused enqueue or a lost request: a line on
// stderr, exit status 1.
// Not covered: events on a Redis Cluster (STREAMQ_EVENTS_REDIS_URL) have other names
// (PROTOCOL.md, "On a Redis Cluster").
import { createHash, randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { createClient } from "redis";

const queue = process.env.STREAMQ_QUEUE ?? "streamq:queue";
const limit = process.env.STREAMQ_QUEUE_LIMIT ?? "-1";
// enqueue.lua is part of the protocol: vendor it from the streamq release your workers run
// (or point at the installed Python package's streamq/protocol/lua), never rewrite it.
const luaDir = process.env.STREAMQ_LUA_DIR ?? fileURLToPath(new URL("../../../streamq/protocol/lua", import.meta.url));
// Every script runs behind _keys.lua, the key names the scripts share: its text first.
const script = ["_keys.lua", "enqueue.lua"].map((file) => readFileSync(join(luaDir, file), "utf8")).join("");
const prompt = process.argv.slice(2).join(" ") || "The key to happiness is";

const id = `node-${randomUUID()}`; // the job id too: [A-Za-z0-9][A-Za-z0-9._:-]{0,127}
const events = `streamq:events:${id}`; // the live channel and the replay log share this name
const redis = createClient({ url: process.env.REDIS_URL ?? "redis://localhost:6379" });
const subscriber = redis.duplicate(); // a subscribed connection runs nothing else
// A lost connection ends the run; a service would reconnect, resubscribe and read the log from `next`.
for (const client of [redis, subscriber]) client.on("error", (error) => fail(`redis: ${error.message}`));

let next = 0; // the next seq to print: events are numbered 0, 1, 2 ... with no gap
let done = false;
let heardAt = Date.now();
let watchdog;
let work = Promise.resolve(); // live messages, log reads and checks run one at a time, in order
const serially = (step) => (work = work.then(step).catch((error) => fail(error.message)));

function end(code, message) {
  if (done) return;
  done = true;
  if (message) console.error(message);
  process.exitCode = code;
  clearInterval(watchdog);
  redis.destroy(); // no QUIT: the producer role is not granted it
  subscriber.destroy();
}
const fail = (message) => end(1, message);

// Print the event if it is the next one; false if one is missing before it.
function take(event) {
  if (event.seq < next || done) return true; // already printed: the log and the channel overlap
  if (event.seq > next) return false;
  next += 1;
  if (event.type === "chunk") process.stdout.write(event.text); // one completion: n is 1
  if (event.type === "final") {
    process.stdout.write(`\n[${event.finish_reasons.join(",")}] ${event.prompt_tokens} ${event.completion_tokens}\n`);
    end(0);
  }
  if (event.type === "error") fail(`error ${event.code}: ${event.message}`);
  return true;
}

// Everything logged from `next` on: the log's entry ids are 0-<seq + 1>.
async function readLog() {
  for (let page = 1000; !done; ) {
    const entries = await redis.xRange(events, `0-${next + 1}`, "+", { COUNT: page });
    entries.forEach(({ message }) => take(JSON.parse(message.event)));
    if (entries.length < page) return;
  }
}

// A live message; one that comes after a gap (lost with a connection) sends us to the log,
// which has every event before it is published.
const onMessage = (message) =>
  serially(async () => {
    heardAt = Date.now();
    if (!take(JSON.parse(message))) await readLog();
  });

// After 30 s of silence, look for the job rather than wait forever: queued or running, it
// stays in the queue, and a running one holds its lease. Looked for before the log is read (a
// request is ended in its log before its job goes): gone at two checks, with no end logged,
// the request is lost.
let missing = 0;
const check = () =>
  serially(async () => {
    if (done || Date.now() - heardAt < 30_000) return;
    const alive = (await redis.zScore(queue, id)) !== null || (await redis.exists(`arq:in-progress:${id}`)) > 0;
    await readLog();
    missing = alive ? 0 : missing + 1;
    if (missing >= 2) fail(`request ${id} is neither queued nor running, and its stream never ended`);
  });

// The job is arq's (PROTOCOL.md, "The job payload"). enqueue.lua stores, queues and indexes it
// for the claim (a bare SET and ZADD would wait behind every indexed job) and wakes the
// workers; KEYS and ARGV as its header lists them, the optional ones after the delay left out.
const request = { request_id: id, prompt, sampling: { max_tokens: 16, temperature: 0 } };
const job = JSON.stringify({ t: 1, f: "generate", a: [request], k: {}, et: Date.now() });
const keys = [`arq:job:${id}`, queue, events];
const args = [job, "86400000", id, "streamq:wakeup", queue, limit, `arq:result:${id}`, "0", "default", "0"];
const sha = createHash("sha1").update(script).digest("hex");

// EVALSHA, loading the script if Redis lacks it: the producer role may not run EVAL.
async function enqueue() {
  try {
    return await redis.evalSha(sha, { keys, arguments: args });
  } catch (error) {
    if (!error.message.startsWith("NOSCRIPT")) throw error;
    await redis.scriptLoad(script);
    return await redis.evalSha(sha, { keys, arguments: args });
  }
}

try {
  await Promise.all([redis.connect(), subscriber.connect()]);
  await subscriber.subscribe(events, onMessage); // before the job exists: no event goes out unseen
  watchdog = setInterval(check, 5_000);
  const outcome = await enqueue();
  if (outcome === 0) fail(`request id ${id} is in use (queued, running, or its log still kept)`);
  if (outcome === -1) fail(`queue ${queue} already holds ${limit} jobs (its limit): try again later`);
  if (outcome === 1) {
    console.error(`queued ${id}`);
    serially(readLog); // where a reader that joins late, or again, starts
  }
} catch (error) {
  fail(error.message);
}
