// streamq dashboard: hash routes over one live snapshot stream, a request's live view, a playground.
// Plain ES module, no build step. Every value from the server reaches the page as text
// (textContent / Text nodes), never as HTML. SSE is read with fetch + a small parser, because
// EventSource cannot send the Authorization header.

const KEY_STORAGE = "streamq.dashboard.apiKey";
// The gateway may sit under a path prefix behind a proxy: everything is relative to where /dashboard is.
const BASE = location.pathname.replace(/\/dashboard(\/.*)?$/, "");
const LIVE_STALE_MS = 6000; // no snapshot for this long (they come every second): reconnect
const BACKOFF_MS = [500, 1000, 2000, 4000, 5000];
const MAX_EVENT_ROWS = 300; // the request view's events list keeps the newest rows only
// The replay log arrives in a burst when a stream (re)connects: the observed rate counts
// only chunks that arrive after this long, when they come as the worker makes them.
const REPLAY_SETTLE_MS = 1000;

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  snapshot: null,
  snapshotAt: 0,
};

// ---------------------------------------------------------------- DOM helpers

/** An element; children are Nodes or plain values (appended as text, never parsed). */
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  appendAll(el, children);
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  appendAll(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "testid") el.setAttribute("data-testid", value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
}

function appendAll(el, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

function setText(el, text) {
  const value = String(text);
  if (el.textContent !== value) el.textContent = value;
}

// ---------------------------------------------------------------- formatting

function fmtNumber(x, digits = 1) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  if (Number.isInteger(x)) return x.toLocaleString("en-US");
  return x.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function fmtRate(x) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  if (x === 0) return "0";
  return fmtNumber(x, x >= 100 ? 0 : 1);
}

/** A fraction (0..1) as a percentage, "62.5%"; "–" when there is none (nothing to divide). */
function fmtPercent(x) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return `${fmtNumber(x * 100, 1)}%`;
}

/** Milliseconds for a person: "12.3 ms", or seconds from 1000 ms on ("1.24 s"). */
function fmtMs(ms) {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return "–";
  if (ms >= 1000) return `${(ms / 1000).toFixed(ms >= 10000 ? 1 : 2)} s`;
  if (ms >= 100) return `${ms.toFixed(0)} ms`;
  if (ms >= 10) return `${ms.toFixed(1)} ms`;
  return `${ms.toFixed(2)} ms`;
}

/** A duration in seconds, coarse as a person says it: "12 s", "12 min", "3 h 5 min", "2 d". */
function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const sec = Math.max(0, seconds);
  if (sec < 10) return `${sec.toFixed(1)} s`;
  if (sec < 60) return `${Math.floor(sec)} s`;
  if (sec < 3600) return `${Math.floor(sec / 60)} min`;
  if (sec < 86400) {
    const hours = Math.floor(sec / 3600);
    const minutes = Math.floor((sec % 3600) / 60);
    return minutes ? `${hours} h ${minutes} min` : `${hours} h`;
  }
  return `${Math.floor(sec / 86400)} d`;
}

/** Bytes for a person: "512 B", "12.3 MB", "1.0 GB" (powers of 1024, as Redis's maxmemory). */
function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${units[unit]}`;
}

/** Redis's memory, its limit and policy; "bad" once it is full (writes refused) or its policy evicts. */
function redisMemoryText(memory) {
  if (!memory) return { text: "Redis memory: not readable (INFO refused to the gateway's Redis user)", bad: false };
  const evicts = memory.policy !== "noeviction";
  const full = memory.max_bytes > 0 && memory.used_bytes >= memory.max_bytes;
  const limit = memory.max_bytes > 0 ? ` of ${fmtBytes(memory.max_bytes)} (${fmtPercent(memory.used_bytes / memory.max_bytes)})` : ", no maxmemory";
  let text = `Redis memory: ${fmtBytes(memory.used_bytes)}${limit}, maxmemory-policy ${memory.policy}`;
  if (full) text += evicts ? " · full: Redis is deleting keys" : " · full: Redis refuses writes, workers wait";
  else if (evicts) text += " · evicting policy: a full Redis deletes streamq's keys (set noeviction)";
  return { text, bad: full || evicts };
}

function fmtAgo(ms, nowMs) {
  if (!ms) return "–";
  return `${fmtDuration((nowMs - ms) / 1000)} ago`;
}

function fmtClock(ms) {
  return ms ? new Date(ms).toLocaleString() : "";
}

function fmtWindow(seconds) {
  return seconds % 60 === 0 ? `${seconds / 60} min` : `${seconds} s`;
}

function shortId(id, keep = 14) {
  return id.length > keep + 1 ? `${id.slice(0, keep)}…` : id;
}

// ---------------------------------------------------------------- API access

class AuthNeeded extends Error {}

function authHeaders(extra = {}) {
  const headers = new Headers(extra);
  if (state.key) headers.set("Authorization", `Bearer ${state.key}`);
  return headers;
}

/** fetch with the key; a 401/403 opens the key form with the server's message and throws AuthNeeded. */
async function apiFetch(path, options = {}) {
  const response = await fetch(BASE + path, { ...options, headers: authHeaders(options.headers) });
  if (response.status === 401 || response.status === 403) {
    const message = await errorMessage(response);
    showKeyForm(message);
    throw new AuthNeeded(message);
  }
  return response;
}

/** The message of an error response: OpenAI's {"error": {"message"}} shape, FastAPI's {"detail"}, or the status. */
async function errorMessage(response) {
  const fallback = `HTTP ${response.status} ${response.statusText}`.trim();
  try {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      const message = body?.error?.message ?? body?.detail ?? body?.message;
      if (message) return typeof message === "string" ? message : JSON.stringify(message);
    } catch {
      /* not JSON */
    }
    return text ? `${fallback}: ${text.slice(0, 300)}` : fallback;
  } catch {
    return fallback;
  }
}

/** Server-sent events from a fetch response: yields {event, data, id} per dispatched event. */
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let event = "message";
  let data = [];
  let id = null;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) yield { event, data: data.join("\n"), id };
          event = "message";
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue; // a comment (keep-alive)
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "event") event = val;
        else if (field === "data") data.push(val);
        else if (field === "id") id = val;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// ---------------------------------------------------------------- the API key form

const keyPanel = document.getElementById("key-panel");
const keyInput = document.getElementById("key-input");
const keyMessage = document.getElementById("key-message");

function showKeyForm(message) {
  keyMessage.textContent = message || "This gateway needs an API key.";
  keyPanel.hidden = false;
  setLiveStatus("key", "API key needed");
  keyInput.focus();
}

document.getElementById("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = keyInput.value.trim();
  if (state.key) sessionStorage.setItem(KEY_STORAGE, state.key);
  else sessionStorage.removeItem(KEY_STORAGE);
  keyInput.value = "";
  keyPanel.hidden = true;
  live.restart();
  route();
});
document.getElementById("key-forget").addEventListener("click", () => {
  state.key = "";
  sessionStorage.removeItem(KEY_STORAGE);
  keyInput.value = "";
  keyPanel.hidden = true;
  live.restart();
  route();
});
document.getElementById("key-close").addEventListener("click", () => {
  keyPanel.hidden = true;
});
document.getElementById("key-button").addEventListener("click", () => {
  if (!keyPanel.hidden) {
    keyPanel.hidden = true;
    return;
  }
  showKeyForm(
    state.key
      ? "A key is set (kept in this tab's session storage only). Enter another, or forget it."
      : "No key is set. Enter an operator key if this gateway needs one (it is kept in this tab only).",
  );
});

// ---------------------------------------------------------------- the live snapshot stream

const liveStatus = document.querySelector('[data-testid="live-status"]');
function setLiveStatus(kind, text) {
  liveStatus.dataset.state = kind;
  setText(liveStatus, text || kind);
}

const live = {
  controller: null,
  retry: 0,
  timer: null,

  async connect() {
    clearTimeout(this.timer);
    const controller = new AbortController();
    this.controller = controller;
    try {
      const response = await apiFetch("/dashboard/api/live", {
        signal: controller.signal,
        headers: { Accept: "text/event-stream" },
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      for await (const ev of sseEvents(response)) {
        if (ev.event !== "snapshot") continue;
        state.snapshot = JSON.parse(ev.data);
        state.snapshotAt = Date.now();
        this.retry = 0;
        setLiveStatus("live", "live");
        current?.view.update?.(state.snapshot);
      }
      throw new Error("the live stream closed");
    } catch (err) {
      if (controller.signal.aborted || this.controller !== controller) return;
      this.controller = null;
      if (err instanceof AuthNeeded) return; // a saved key restarts it
      const delay = BACKOFF_MS[Math.min(this.retry, BACKOFF_MS.length - 1)];
      this.retry += 1;
      setLiveStatus("reconnecting", `reconnecting in ${delay / 1000} s (${err.message || err})`);
      this.timer = setTimeout(() => this.connect(), delay);
    }
  },

  restart() {
    const old = this.controller;
    this.controller = null;
    old?.abort();
    this.retry = 0;
    setLiveStatus("connecting", "connecting");
    this.connect();
  },
};

// A stream that stopped delivering without an error (a proxy holding it open) is restarted.
setInterval(() => {
  if (live.controller && state.snapshotAt && Date.now() - state.snapshotAt > LIVE_STALE_MS) {
    state.snapshotAt = Date.now();
    live.restart();
  }
}, 2000);

// ---------------------------------------------------------------- tables that keep their rows

/**
 * A table whose rows are keyed (request id, worker id) and updated in place each second,
 * so that a row under the pointer is not replaced between mouse down and up.
 * Cell values: a string, or {text, title, cls, href}.
 */
function keyedTable(columns, { testid, rowTestid, empty, onRowClick }) {
  const tbody = h("tbody");
  const table = h(
    "table",
    { class: "data", testid },
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { class: c.num ? "num" : null }, c.title)))),
    tbody,
  );
  const emptyNote = h("p", { class: "empty", testid: `${testid}-empty` }, empty);
  const el = h("div", { class: "table-wrap" }, table, emptyNote);
  const rows = new Map();

  function update(items, keyOf, cellsOf) {
    const seen = new Set();
    items.forEach((item, position) => {
      const key = keyOf(item);
      seen.add(key);
      let tr = rows.get(key);
      if (!tr) {
        tr = h("tr", { testid: rowTestid, "data-key": key });
        for (const c of columns) tr.append(h("td", { class: [c.num ? "num" : "", c.cls || ""].join(" ").trim() || null }));
        if (onRowClick) {
          tr.classList.add("clickable");
          tr.addEventListener("click", (e) => {
            if (e.target.closest("a")) return; // the link navigates itself
            onRowClick(key);
          });
        }
        rows.set(key, tr);
      }
      cellsOf(item).forEach((value, i) => fillCell(tr.children[i], value));
      if (tbody.children[position] !== tr) tbody.insertBefore(tr, tbody.children[position] || null);
    });
    for (const [key, tr] of rows) {
      if (!seen.has(key)) {
        tr.remove();
        rows.delete(key);
      }
    }
    table.hidden = items.length === 0;
    emptyNote.hidden = items.length !== 0;
  }
  return { el, update };
}

function fillCell(td, value) {
  const cell = typeof value === "object" && value !== null ? value : { text: value };
  const text = cell.text === null || cell.text === undefined ? "–" : String(cell.text);
  if (cell.href) {
    let a = td.firstElementChild;
    if (!a || a.tagName !== "A") {
      a = h("a");
      td.replaceChildren(a);
    }
    if (a.getAttribute("href") !== cell.href) a.setAttribute("href", cell.href);
    setText(a, text);
  } else {
    setText(td, text);
  }
  if (cell.testid) td.dataset.testid = cell.testid;
  if (cell.title) td.title = cell.title;
  else td.removeAttribute("title");
  // Classes a value brought (state colours) replace those of the previous value; the column's stay.
  const previous = td.dataset.valueClasses ? td.dataset.valueClasses.split(" ") : [];
  if (previous.length) td.classList.remove(...previous);
  const next = cell.cls ? cell.cls.split(" ").filter(Boolean) : [];
  if (next.length) td.classList.add(...next);
  td.dataset.valueClasses = next.join(" ");
}

function requestHref(id) {
  return `#/requests/${encodeURIComponent(id)}`;
}

// ---------------------------------------------------------------- charts

/** 1, 2 or 5 times a power of ten, at least x (and at least `least`). */
function niceCeil(x, least = 1) {
  const v = Math.max(x, least);
  const power = 10 ** Math.floor(Math.log10(v));
  for (const step of [1, 2, 5, 10]) if (step * power >= v) return step * power;
  return 10 * power;
}

/**
 * A small line chart over the last `windowMs` up to `nowMs`: a time axis ("-5 min" … "now"),
 * the y range labelled at 0, half and top, one polyline per series.
 */
function lineChart({ series, nowMs, windowMs, label, testid, format = fmtNumber, least = 1 }) {
  const W = 320;
  const H = 120;
  const left = 38;
  const right = 10;
  const top = 8;
  const bottom = 20;
  const from = nowMs - windowMs;
  const values = series.flatMap((sr) => sr.points.filter((p) => p.t >= from).map((p) => p.v));
  const yMax = niceCeil(Math.max(0, ...values), least);
  const x = (t) => left + ((t - from) / windowMs) * (W - left - right);
  const y = (v) => top + (1 - v / yMax) * (H - top - bottom);
  const svg = s("svg", {
    class: "chart",
    viewBox: `0 0 ${W} ${H}`,
    role: "img",
    "aria-label": label,
    testid,
    preserveAspectRatio: "xMidYMid meet",
  });
  for (const v of [0, yMax / 2, yMax]) {
    svg.append(
      s("line", { class: "axis", x1: left, x2: W - right, y1: y(v), y2: y(v), "stroke-dasharray": v ? "2 3" : null }),
      s("text", { x: left - 4, y: y(v) + 3, "text-anchor": "end" }, format(v)),
    );
  }
  const minutes = windowMs / 60000;
  const ticks = [
    [from, `-${fmtNumber(minutes)} min`, "start"],
    [from + windowMs / 2, `-${fmtNumber(minutes / 2)} min`, "middle"],
    [nowMs, "now", "end"],
  ];
  for (const [t, text, anchor] of ticks) {
    svg.append(
      s("line", { class: "axis", x1: x(t), x2: x(t), y1: H - bottom, y2: H - bottom + 3 }),
      s("text", { x: x(t), y: H - 6, "text-anchor": anchor }, text),
    );
  }
  for (const sr of series) {
    const points = sr.points.filter((p) => p.t >= from && p.t <= nowMs + 1000);
    if (!points.length) continue;
    const coords = points.map((p) => `${x(Math.min(p.t, nowMs)).toFixed(1)},${y(p.v).toFixed(1)}`);
    if (points.length === 1) coords.push(`${x(nowMs).toFixed(1)},${y(points[0].v).toFixed(1)}`);
    const last = points[points.length - 1].v;
    const [lastX, lastY] = coords[coords.length - 1].split(",");
    svg.append(s("circle", { class: `dot ${sr.cls}`, cx: lastX, cy: lastY, r: 2.5 }));
    svg.append(
      s(
        "polyline",
        { class: sr.cls, points: coords.join(" "), "data-series": sr.name, "data-last": last, "data-count": points.length },
        s("title", {}, `${sr.name}: ${format(last)} at the last point`),
      ),
    );
  }
  return svg;
}

function legend(items) {
  return h(
    "div",
    { class: "legend" },
    items.map(([cls, name, value]) => h("span", {}, h("span", { class: `sw ${cls}` }), `${name} `, h("b", {}, value))),
  );
}

// ---------------------------------------------------------------- views

const main = document.getElementById("view");

function stat(label, value, testid, unit, title) {
  return h(
    "div",
    { class: "stat", title },
    h("div", { class: "label" }, label),
    h("div", { class: "value", testid }, value, unit ? h("span", { class: "unit" }, unit) : null),
  );
}

function latencyRow(name, quantiles, testid) {
  const cell = (q) => h("td", { testid: `${testid}-${q}` }, quantiles ? fmtMs(quantiles[q]) : "–");
  return h("tr", {}, h("td", {}, name), cell("p50"), cell("p90"), cell("p99"));
}

/** Prefix-aware pickup: the share of requests with prefix keys that the worker holding
 * them claimed, and beside it the holds whose window passed (their worker stayed busy). */
function affinityStat(model, windowText) {
  const withPrefix = model.affinity_hits + model.affinity_misses;
  return h(
    "div",
    {
      class: "stat",
      title: withPrefix
        ? `${fmtNumber(model.affinity_hits)} of ${fmtNumber(withPrefix)} requests with prefix keys went to the worker that served their prefix; ${fmtNumber(model.affinity_expired)} held requests waited out their window`
        : "no request with prefix keys was claimed",
    },
    h("div", { class: "label" }, `Affinity hits, ${windowText}`),
    h(
      "div",
      { class: "value" },
      h("span", { testid: "model-affinity-hit-rate" }, fmtPercent(model.affinity_hit_rate)),
      h("span", { class: "unit", testid: "model-affinity-expired" }, `${fmtNumber(model.affinity_expired)} expired`),
    ),
  );
}

function modelCard(model, snap) {
  const windowMs = snap.window_s * 1000;
  const windowText = fmtWindow(snap.window_s);
  // The chart ends at the values shown above it: the snapshot's own, at its time.
  const history = [...(model.history || [])];
  const newest = history[history.length - 1];
  if (!newest || newest.t_ms < snap.now_ms) {
    history.push({ t_ms: snap.now_ms, waiting: model.waiting, running: model.running, tokens_per_s: model.tokens_per_s });
  }
  const errorCodes = Object.entries(model.errors || {}).filter(([, n]) => n > 0);
  const errorTotal = errorCodes.reduce((sum, [, n]) => sum + n, 0);
  return h(
    "article",
    { class: "panel card", testid: "model-card", "data-model": model.model },
    h(
      "div",
      { class: "card-head" },
      h("h2", { testid: "model-name" }, model.model),
      h("span", { class: "muted mono", title: "the model's queue" }, model.queue),
    ),
    h(
      "div",
      { class: "stats" },
      stat("Waiting", fmtNumber(model.waiting), "model-waiting"),
      stat("Running", fmtNumber(model.running), "model-running"),
      stat("Live workers", fmtNumber(model.live_workers), "model-live-workers"),
      stat("Tokens/s", fmtRate(model.tokens_per_s), "model-tokens-per-s"),
      stat(`Finished, ${windowText}`, fmtNumber(model.finished), "model-finished"),
      stat(`Errors, ${windowText}`, fmtNumber(errorTotal), "model-errors-total"),
      affinityStat(model, windowText),
      stat(
        `Prefix cache hits, ${windowText}`,
        fmtPercent(model.prefix_cache_hit_rate),
        "model-prefix-cache-hit-rate",
        null,
        model.prefix_cache_queries
          ? `${fmtNumber(model.prefix_cache_hits)} of ${fmtNumber(model.prefix_cache_queries)} prompt tokens found in vLLM's prefix cache`
          : "vLLM counted no prefix-cache lookup (a scripted engine, or --disable-log-stats)",
      ),
    ),
    h(
      "table",
      { class: "lat", testid: "model-latency" },
      h(
        "thead",
        {},
        h("tr", {}, h("th", {}, `Latency, last ${windowText}`), h("th", {}, "p50"), h("th", {}, "p90"), h("th", {}, "p99")),
      ),
      h(
        "tbody",
        {},
        latencyRow("Time to first token", model.ttft_ms, "model-ttft"),
        latencyRow("Inter-token latency", model.itl_ms, "model-itl"),
      ),
    ),
    h("h3", {}, `Errors by code, last ${windowText}`),
    h(
      "div",
      { class: "chips", testid: "model-errors" },
      errorCodes.length
        ? errorCodes.map(([code, n]) => h("span", { class: "chip bad" }, `${code}: ${fmtNumber(n)}`))
        : h("span", { class: "muted" }, "none"),
    ),
    h(
      "div",
      { class: "charts" },
      h(
        "figure",
        {},
        h("figcaption", {}, `Queue, last ${windowText}`),
        lineChart({
      series: [
        { name: "waiting", cls: "waiting", points: history.map((p) => ({ t: p.t_ms, v: p.waiting })) },
        { name: "running", cls: "running", points: history.map((p) => ({ t: p.t_ms, v: p.running })) },
      ],
      nowMs: snap.now_ms,
      windowMs,
      label: `waiting and running requests of ${model.model} over the last ${windowText}`,
      testid: "queue-chart",
      format: (v) => fmtNumber(v, 1),
    }),
        legend([
          ["waiting", "waiting", fmtNumber(model.waiting)],
          ["running", "running", fmtNumber(model.running)],
        ]),
      ),
      h(
        "figure",
        {},
        h("figcaption", {}, `Tokens per second, last ${windowText}`),
        lineChart({
      series: [{ name: "tokens/s", cls: "tokens", points: history.map((p) => ({ t: p.t_ms, v: p.tokens_per_s })) }],
      nowMs: snap.now_ms,
      windowMs,
      label: `tokens per second of ${model.model} over the last ${windowText}`,
      testid: "tokens-chart",
      format: fmtRate,
    }),
        legend([["tokens", "tokens/s", fmtRate(model.tokens_per_s)]]),
      ),
    ),
  );
}

function overviewView() {
  const summary = h("p", { class: "muted", testid: "overview-summary" }, "Waiting for the first snapshot…");
  const memory = h("p", { class: "muted", testid: "redis-memory" }, "");
  const cards = h("div", { class: "cards", testid: "model-cards" });
  return {
    title: "Overview",
    el: h("section", {}, h("h1", {}, "Overview"), summary, memory, cards),
    update(snap) {
      const redis = redisMemoryText(snap.redis_memory);
      setText(memory, redis.text);
      memory.className = redis.bad ? "bad" : "muted";
      const liveWorkers = snap.workers.filter((w) => w.state === "live").length;
      const waiting = snap.models.reduce((sum, m) => sum + m.waiting, 0);
      setText(
        summary,
        `${liveWorkers} live worker${liveWorkers === 1 ? "" : "s"} · ${snap.models.length} model${
          snap.models.length === 1 ? "" : "s"
        } · ${waiting} waiting · ${snap.running.length} running · as of ${new Date(snap.now_ms).toLocaleTimeString()}`,
      );
      if (!snap.models.length) {
        cards.replaceChildren(h("p", { class: "empty", testid: "no-models" }, "No model has a live worker or queued jobs."));
      } else {
        cards.replaceChildren(...snap.models.map((m) => modelCard(m, snap)));
      }
    },
  };
}

/** A worker's affinity hits of the requests with prefix keys it claimed, since it started. */
function affinityCell(w) {
  const withPrefix = w.affinity_hits + w.affinity_misses;
  return {
    text: withPrefix ? `${fmtNumber(w.affinity_hits)} / ${fmtNumber(withPrefix)}` : "–",
    title: withPrefix
      ? `${fmtPercent(w.affinity_hits / withPrefix)} of the requests with prefix keys it claimed were held for it (since it started)`
      : "it claimed no request with prefix keys",
    testid: "worker-affinity",
  };
}

function workersView() {
  const table = keyedTable(
    [
      { title: "Worker", cls: "id" },
      { title: "State" },
      { title: "Model", cls: "wrap" },
      { title: "Queue", cls: "wrap" },
      { title: "Host" },
      { title: "PID", num: true },
      { title: "Up for" },
      { title: "In flight", num: true },
      { title: "Tokens/s", num: true },
      { title: "Finished", num: true },
      { title: "Errors", num: true },
      { title: "Affinity hits", num: true },
    ],
    { testid: "workers-table", rowTestid: "worker-row", empty: "No worker has reported yet." },
  );
  return {
    title: "Workers",
    el: h(
      "section",
      {},
      h("h1", {}, "Workers"),
      h(
        "p",
        { class: "muted" },
        "Live workers first; workers that stopped (and said why) or were lost (stopped reporting) stay listed for a while.",
      ),
      h("div", { class: "panel" }, table.el),
    ),
    update(snap) {
      table.update(
        snap.workers,
        (w) => w.worker_id,
        (w) => {
          const live = w.state === "live";
          const stateText = live
            ? "live"
            : `${w.state}${w.stop_reason ? `: ${w.stop_reason}` : ""}${
                w.reported_ms ? ` (${fmtAgo(w.reported_ms, snap.now_ms)})` : ""
              }`;
          return [
            { text: shortId(w.worker_id, 16), title: w.worker_id },
            {
              text: stateText,
              cls: `state ${w.state}`,
              title: w.reported_ms ? `last report ${fmtClock(w.reported_ms)}` : "no report yet",
              testid: "worker-state",
            },
            w.adapters.length
              ? {
                  text: `${w.model} + ${w.adapters.length} adapter${w.adapters.length === 1 ? "" : "s"}`,
                  title: `LoRA adapters: ${w.adapters.join(", ")}`,
                  testid: "worker-model",
                }
              : w.model,
            w.queue,
            w.host,
            w.pid ?? "–",
            {
              text: live && w.started_ms ? fmtDuration((snap.now_ms - w.started_ms) / 1000) : "–",
              title: w.started_ms ? `started ${fmtClock(w.started_ms)}` : "",
            },
            { text: live ? fmtNumber(w.in_flight) : "–", testid: "worker-in-flight" },
            {
              text: live ? fmtRate(w.tokens_per_s) : "–",
              title: `${fmtNumber(w.generated_tokens)} tokens generated since it started`,
            },
            fmtNumber(w.requests_finished),
            { text: fmtNumber(w.errors), cls: w.errors ? "bad" : "" },
            affinityCell(w),
          ];
        },
      );
    },
  };
}

function requestsView() {
  const open = (id) => {
    location.hash = requestHref(id);
  };
  const running = keyedTable(
    [
      { title: "Request", cls: "id" },
      { title: "Model", cls: "wrap" },
      { title: "Tenant" },
      { title: "Priority", num: true },
      { title: "Attempt", num: true },
      { title: "Tokens", num: true },
      { title: "Age", num: true },
    ],
    { testid: "running-table", rowTestid: "running-row", empty: "Nothing is running.", onRowClick: open },
  );
  const recent = keyedTable(
    [
      { title: "Request", cls: "id" },
      { title: "Model", cls: "wrap" },
      { title: "State" },
      { title: "Reason / code" },
      { title: "Tokens", num: true },
      { title: "Ended", num: true },
    ],
    { testid: "recent-table", rowTestid: "recent-row", empty: "No request has ended recently.", onRowClick: open },
  );
  const runningCount = h("span", { class: "muted", testid: "running-count" });
  const recentCount = h("span", { class: "muted" });
  return {
    title: "Requests",
    el: h(
      "section",
      {},
      h("h1", {}, "Requests"),
      h("div", { class: "panel" }, h("h2", {}, "Running ", runningCount), running.el),
      h("div", { class: "panel" }, h("h2", {}, "Recently ended ", recentCount), recent.el),
    ),
    update(snap) {
      setText(runningCount, `(${snap.running.length})`);
      setText(recentCount, `(newest first, ${snap.recent.length})`);
      running.update(
        snap.running,
        (r) => r.request_id,
        (r) => [
          { text: r.request_id, href: requestHref(r.request_id), title: r.request_id },
          r.model,
          r.tenant ?? "default",
          fmtNumber(r.priority),
          fmtNumber(r.attempt),
          { text: fmtNumber(r.completion_tokens), testid: "running-tokens" },
          fmtDuration(r.age_s),
        ],
      );
      recent.update(
        snap.recent,
        (r) => r.request_id,
        (r) => {
          const reason =
            r.state === "failed"
              ? { text: r.error_code ?? "error", title: r.error_message ?? "", cls: "bad" }
              : {
                  text: (r.finish_reasons || []).map((x) => x ?? "–").join(", ") || "–",
                  cls: (r.finish_reasons || []).some((x) => x === "cancelled" || x === "timeout") ? "warn" : "",
                };
          return [
            { text: r.request_id, href: requestHref(r.request_id), title: r.request_id },
            r.model ?? "–",
            { text: r.state, cls: `state ${r.state}` },
            reason,
            { text: fmtNumber(r.completion_tokens), title: `prompt ${r.prompt_tokens ?? "–"} tokens` },
            { text: fmtAgo(r.ended_ms, snap.now_ms), title: fmtClock(r.ended_ms) },
          ];
        },
      );
    },
  };
}

/** A batch's progress: lines answered (completed + failed) of its total, as text and a share. */
function batchProgress(b) {
  const done = b.completed + b.failed;
  if (!b.total) return { text: b.status === "validating" ? "validating…" : "–", title: "no line counted yet" };
  return {
    text: `${fmtNumber(done)} / ${fmtNumber(b.total)} (${fmtPercent(done / b.total)})`,
    title: `${fmtNumber(b.completed)} completed, ${fmtNumber(b.failed)} failed, of ${fmtNumber(b.total)} lines`,
    cls: b.failed ? "warn" : "",
    testid: "batch-progress",
  };
}

const BATCH_STATE_CLASS = {
  validating: "queued",
  in_progress: "running",
  finalizing: "running",
  cancelling: "queued",
  completed: "finished",
  failed: "failed",
  expired: "failed",
  cancelled: "stopped",
};

function batchesView() {
  const table = keyedTable(
    [
      { title: "Batch", cls: "id" },
      { title: "Owner" },
      { title: "Status" },
      { title: "Progress", num: true },
      { title: "Endpoint" },
      { title: "Model", cls: "wrap" },
      { title: "Created", num: true },
      { title: "Ended", num: true },
    ],
    { testid: "batches-table", rowTestid: "batch-row", empty: "No batch is running or ended in the last hour." },
  );
  const count = h("span", { class: "muted", testid: "batches-count" });
  return {
    title: "Batches",
    el: h(
      "section",
      {},
      h("h1", {}, "Batches ", count),
      h(
        "p",
        { class: "muted" },
        "The Batch API's batches, every owner's: those not finished, oldest first, then those that ended in the last hour.",
      ),
      h("div", { class: "panel" }, table.el),
    ),
    update(snap) {
      const batches = snap.batches || [];
      const open = batches.filter((b) => b.ended_at === null).length;
      setText(count, `(${open} not finished, ${batches.length - open} ended)`);
      table.update(
        batches,
        (b) => b.id,
        (b) => [
          { text: shortId(b.id, 20), title: b.id },
          b.owner,
          { text: b.status, cls: `state ${BATCH_STATE_CLASS[b.status] || ""}`, testid: "batch-status" },
          batchProgress(b),
          b.endpoint,
          b.model ?? "–",
          { text: fmtAgo(b.created_at * 1000, snap.now_ms), title: fmtClock(b.created_at * 1000) },
          b.ended_at === null
            ? { text: "–", title: `expires ${fmtClock(b.expires_at * 1000)}` }
            : { text: fmtAgo(b.ended_at * 1000, snap.now_ms), title: fmtClock(b.ended_at * 1000) },
        ],
      );
    },
  };
}

function kvList(pairs) {
  return h(
    "dl",
    { class: "kv" },
    pairs.flatMap(([label, value, testid]) => [h("dt", {}, label), h("dd", { testid }, value ?? "–")]),
  );
}

function requestView(requestId) {
  const path = `/dashboard/api/requests/${encodeURIComponent(requestId)}`;
  const opened = performance.now();
  let destroyed = false;
  let ended = false;
  let controller = null;
  let lastSeq = -1;
  let firstEventAt = null;
  let lastChunkAt = null;
  let tokensReceived = 0;
  let connectedAt = null; // when the current events stream answered
  let liveFirstAt = null; // the first chunk after the replay settled
  let liveTokens = 0; // tokens of later chunks
  let eventCount = 0;
  let statusTimer = null;

  const cancelButton = h("button", { type: "button", class: "danger", testid: "cancel-button" }, "Cancel");
  const cancelResult = h("span", { class: "muted", testid: "cancel-result" });
  const statusBox = h("div", { testid: "request-status" }, h("p", { class: "muted" }, "Loading status…"));
  const streamNote = h("p", { class: "muted", testid: "stream-note" }, "Connecting to the event stream…");
  const texts = h("div", { testid: "request-texts" });
  const textByIndex = new Map();
  const timings = h("div", { testid: "request-timings" });
  const finalBox = h("div", { testid: "request-final" }, h("p", { class: "muted" }, "Not ended yet."));
  const eventsBody = h("tbody");
  const eventsNote = h("p", { class: "muted" });
  const eventsTable = h(
    "table",
    { class: "data", testid: "request-events" },
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        h("th", { class: "num" }, "Seq"),
        h("th", {}, "Type"),
        h("th", { class: "num" }, "Index"),
        h("th", { class: "num" }, "Arrived"),
        h("th", {}, "Content"),
      ),
    ),
    eventsBody,
  );

  function textFor(index) {
    let pre = textByIndex.get(index);
    if (!pre) {
      pre = h("pre", { class: "stream-text", testid: "request-text", "data-index": index });
      textByIndex.set(index, pre);
      const heading = h("h3", { class: "completion-heading" }, `Completion ${index}`);
      texts.append(heading, pre);
      // One completion needs no heading; with n > 1 each gets one.
      const many = textByIndex.size > 1;
      for (const el of texts.querySelectorAll(".completion-heading")) el.hidden = !many;
    }
    return pre;
  }

  function renderTimings() {
    const seconds = (t) => (t === null ? "–" : `${((t - opened) / 1000).toFixed(2)} s`);
    const span = liveFirstAt !== null ? (lastChunkAt - liveFirstAt) / 1000 : 0;
    timings.replaceChildren(
      kvList([
        ["First event after opening", seconds(firstEventAt), "timing-first-event"],
        ["Events received", fmtNumber(eventCount), "timing-events"],
        ["Tokens received", fmtNumber(tokensReceived), "timing-tokens"],
        [
          "Tokens/s, as observed",
          span >= 0.5 ? fmtRate(liveTokens / span) : ended ? "– (replayed at once)" : "–",
          "timing-tokens-per-s",
        ],
      ]),
    );
  }

  function renderStatus(status) {
    const rows = [
      ["State", h("span", { class: `state ${status.state}`, testid: "request-state" }, status.state)],
    ];
    if (status.queue) rows.push(["Queue", status.queue]);
    if (status.priority !== undefined && status.priority !== null) rows.push(["Priority", fmtNumber(status.priority)]);
    if (status.position !== undefined) rows.push(["Position in queue", fmtNumber(status.position)]);
    if (status.waited_s !== undefined) rows.push(["Since enqueued", fmtDuration(status.waited_s)]);
    if (status.worker_id) rows.push(["Worker", status.worker_id]);
    if (status.attempt !== undefined) rows.push(["Attempt", fmtNumber(status.attempt)]);
    if (status.completion_tokens !== undefined)
      rows.push(["Completion tokens", fmtNumber(status.completion_tokens), "status-completion-tokens"]);
    if (status.prompt_tokens !== undefined) rows.push(["Prompt tokens", fmtNumber(status.prompt_tokens)]);
    if (status.finish_reasons) rows.push(["Finish reasons", status.finish_reasons.join(", "), "status-finish-reasons"]);
    if (status.started_ms) rows.push(["Started", fmtClock(status.started_ms)]);
    if (status.ended_ms) rows.push(["Ended", fmtClock(status.ended_ms)]);
    if (status.started_ms && status.ended_ms > status.started_ms && status.completion_tokens) {
      const seconds = (status.ended_ms - status.started_ms) / 1000;
      rows.push(["Tokens/s, start to end", fmtRate(status.completion_tokens / seconds)]);
    }
    if (status.error_code) rows.push(["Error", `${status.error_code}: ${status.error_message ?? ""}`]);
    if (status.callback) rows.push(["Callback", `${status.callback.state} (${status.callback.url})`]);
    statusBox.replaceChildren(kvList(rows));
    if (["finished", "failed"].includes(status.state)) markEnded();
  }

  async function loadStatus() {
    if (destroyed) return;
    try {
      const response = await apiFetch(path);
      if (response.status === 404) {
        statusBox.replaceChildren(
          h("p", { class: "bad", testid: "request-state" }, "unknown: never submitted, or everything about it expired"),
        );
        return;
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      renderStatus(await response.json());
    } catch (err) {
      if (err instanceof AuthNeeded) return;
      statusBox.replaceChildren(h("p", { class: "error-box" }, `Status: ${err.message || err}`));
    }
    if (!ended && !destroyed) statusTimer = setTimeout(loadStatus, 2000);
  }

  function markEnded() {
    if (ended) return;
    ended = true;
    cancelButton.hidden = true;
    clearTimeout(statusTimer);
  }

  function addEventRow(ev, at) {
    let content = "";
    if (ev.type === "chunk") content = JSON.stringify(ev.text) + (ev.finish_reason ? `  (finish: ${ev.finish_reason})` : "");
    else if (ev.type === "final") content = `finish reasons: ${(ev.finish_reasons || []).join(", ")}`;
    else if (ev.type === "error") content = `${ev.code}: ${ev.message}`;
    eventsBody.prepend(
      h(
        "tr",
        { testid: "event-row", "data-type": ev.type },
        h("td", { class: "num" }, fmtNumber(ev.seq)),
        h("td", {}, ev.type),
        h("td", { class: "num" }, ev.type === "chunk" ? fmtNumber(ev.index ?? 0) : ""),
        h("td", { class: "num", title: new Date().toLocaleTimeString() }, `+${((at - opened) / 1000).toFixed(3)} s`),
        h("td", { class: "mono" }, content.length > 120 ? `${content.slice(0, 120)}…` : content),
      ),
    );
    while (eventsBody.children.length > MAX_EVENT_ROWS) eventsBody.lastElementChild.remove();
    setText(
      eventsNote,
      eventCount > MAX_EVENT_ROWS
        ? `${eventCount} events, newest first (the newest ${MAX_EVENT_ROWS} shown).`
        : `${eventCount} events, newest first.`,
    );
  }

  function handleEvent(ev) {
    const at = performance.now();
    const data = JSON.parse(ev.data);
    if (typeof data.seq === "number") {
      if (data.seq <= lastSeq) return; // already shown before a reconnect replayed it
      lastSeq = data.seq;
    }
    data.type = data.type || ev.event;
    eventCount += 1;
    if (firstEventAt === null) firstEventAt = at;
    if (data.type === "chunk") {
      const tokens = (data.token_ids || []).length;
      tokensReceived += tokens;
      if (connectedAt !== null && at - connectedAt >= REPLAY_SETTLE_MS) {
        if (liveFirstAt === null) liveFirstAt = at;
        else liveTokens += tokens;
      }
      lastChunkAt = at;
      if (data.text) textFor(data.index ?? 0).append(data.text);
    } else if (data.type === "final") {
      finalBox.replaceChildren(
        kvList([
          ["Outcome", h("span", { class: "state finished" }, "finished"), "final-outcome"],
          ["Finish reasons", (data.finish_reasons || []).map((x) => x ?? "–").join(", "), "final-finish-reasons"],
          ["Prompt tokens", fmtNumber(data.prompt_tokens), "final-prompt-tokens"],
          ["Completion tokens", fmtNumber(data.completion_tokens), "final-completion-tokens"],
        ]),
      );
      markEnded();
    } else if (data.type === "error") {
      finalBox.replaceChildren(
        kvList([
          ["Outcome", h("span", { class: "state failed" }, "failed"), "final-outcome"],
          ["Code", data.code, "final-error-code"],
          ["Message", data.message, "final-error-message"],
        ]),
      );
      markEnded();
    }
    addEventRow(data, at);
    renderTimings();
  }

  async function follow() {
    let retry = 0;
    while (!destroyed && !ended) {
      controller = new AbortController();
      try {
        const response = await apiFetch(`${path}/events`, {
          signal: controller.signal,
          headers: { Accept: "text/event-stream" },
        });
        if (response.status === 404) {
          setText(streamNote, "No events: the request is unknown (never submitted, or its log expired).");
          return;
        }
        if (!response.ok) throw new Error(await errorMessage(response));
        setText(streamNote, "Streaming live: the replay log first, then new events as they arrive.");
        connectedAt = performance.now();
        liveFirstAt = null;
        liveTokens = 0;
        for await (const ev of sseEvents(response)) {
          retry = 0;
          handleEvent(ev);
        }
        if (!ended) throw new Error("the event stream closed before the request's last event");
      } catch (err) {
        if (destroyed) return;
        if (err instanceof AuthNeeded) {
          setText(streamNote, "An API key is needed to follow this request.");
          return; // a saved key renders the view again
        }
        const delay = BACKOFF_MS[Math.min(retry, BACKOFF_MS.length - 1)];
        retry += 1;
        setText(streamNote, `Stream interrupted (${err.message || err}); reconnecting in ${delay / 1000} s…`);
        await sleep(delay);
      }
    }
    if (ended) {
      setText(streamNote, "The request has ended; every event is shown.");
      loadStatus();
    }
  }

  cancelButton.addEventListener("click", async () => {
    cancelButton.disabled = true;
    setText(cancelResult, "Cancelling…");
    try {
      const response = await apiFetch(`${path}/cancel`, { method: "POST" });
      if (!response.ok) throw new Error(await errorMessage(response));
      const body = await response.json();
      setText(
        cancelResult,
        body.cancelled ? "Cancel sent: the request ends as cancelled." : "Nothing to cancel: it had ended already.",
      );
    } catch (err) {
      setText(cancelResult, `Cancel failed: ${err.message || err}`);
      cancelButton.disabled = false;
    }
  });

  renderTimings();
  loadStatus();
  follow();

  return {
    title: `Request ${requestId}`,
    el: h(
      "section",
      {},
      h(
        "div",
        { class: "toolbar" },
        h("a", { href: "#/requests" }, "← Requests"),
        h("h1", { testid: "request-id" }, requestId),
        cancelButton,
        cancelResult,
      ),
      h(
        "div",
        { class: "grid2" },
        h("div", { class: "panel" }, h("h2", {}, "Status"), statusBox),
        h("div", { class: "panel" }, h("h2", {}, "Timings (this page)"), timings, h("h2", {}, "Result"), finalBox),
      ),
      h("div", { class: "panel" }, h("h2", {}, "Text"), streamNote, texts),
      h("div", { class: "panel" }, h("h2", {}, "Events"), eventsNote, h("div", { class: "table-wrap events" }, eventsTable)),
    ),
    destroy() {
      destroyed = true;
      clearTimeout(statusTimer);
      controller?.abort();
    },
  };
}

function playgroundView() {
  const modelSelect = h("select", { testid: "pg-model", "aria-label": "model" });
  const chatRadio = h("input", { type: "radio", name: "pg-mode", value: "chat", checked: true, testid: "pg-mode-chat" });
  const completionRadio = h("input", { type: "radio", name: "pg-mode", value: "completion", testid: "pg-mode-completion" });
  const prompt = h("textarea", { testid: "pg-prompt", spellcheck: "false" });
  prompt.value = "Write a haiku about queues.";
  const promptLabel = h("span");
  const maxTokens = h("input", { type: "number", min: 1, value: 64, testid: "pg-max-tokens" });
  const temperature = h("input", { type: "number", min: 0, max: 2, step: 0.1, value: 0.7, testid: "pg-temperature" });
  const ignoreEos = h("input", { type: "checkbox", testid: "pg-ignore-eos" });
  const send = h("button", { type: "submit", testid: "pg-send" }, "Send");
  const stop = h("button", { type: "button", class: "secondary", testid: "pg-stop", disabled: true }, "Stop");
  const output = h("pre", { class: "stream-text", testid: "pg-output" });
  const errorBox = h("div", { class: "error-box", testid: "pg-error", hidden: true });
  const link = h("a", { testid: "pg-request-link" });
  const stats = {
    state: h("span", { testid: "pg-state" }, "idle"),
    ttft: h("span", { testid: "pg-ttft" }, "–"),
    rate: h("span", { testid: "pg-rate" }, "–"),
    finish: h("span", { testid: "pg-finish" }, "–"),
    usage: h("span", { testid: "pg-usage" }, "–"),
  };
  let controller = null;

  const mode = () => (chatRadio.checked ? "chat" : "completion");
  const describeMode = () =>
    setText(
      promptLabel,
      mode() === "chat"
        ? "Message (plain text is one user message; or a JSON list of {role, content})"
        : "Prompt (sent as is)",
    );
  chatRadio.addEventListener("change", describeMode);
  completionRadio.addEventListener("change", describeMode);
  describeMode();

  function showError(message) {
    errorBox.hidden = false;
    setText(errorBox, message);
  }

  function buildBody() {
    const body = {
      model: modelSelect.value,
      max_tokens: Number(maxTokens.value),
      temperature: Number(temperature.value),
      stream: true,
      stream_options: { include_usage: true },
    };
    if (ignoreEos.checked) body.ignore_eos = true; // vLLM's extension: generate max tokens
    if (mode() === "chat") {
      const text = prompt.value.trim();
      if (text.startsWith("[")) {
        try {
          body.messages = JSON.parse(text);
        } catch (err) {
          throw new Error(`the messages are not valid JSON: ${err.message}`);
        }
      } else {
        body.messages = [{ role: "user", content: prompt.value }];
      }
    } else {
      body.prompt = prompt.value;
    }
    return body;
  }

  async function run() {
    errorBox.hidden = true;
    output.textContent = "";
    link.removeAttribute("href");
    setText(link, "");
    for (const key of ["ttft", "rate", "finish", "usage"]) setText(stats[key], "–");
    let body;
    try {
      if (!modelSelect.value) throw new Error("no model has a live worker to send to");
      body = buildBody();
    } catch (err) {
      showError(err.message);
      return;
    }
    controller = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    setText(stats.state, "waiting for the first token");
    const started = performance.now();
    let firstAt = null;
    let lastAt = null;
    let chunks = 0;
    let usage = null;
    const finishes = [];
    const rate = (tokens) => {
      const span = ((lastAt ?? performance.now()) - firstAt) / 1000;
      return span > 0 ? `${fmtRate(tokens / span)} tokens/s` : "–";
    };
    try {
      const endpoint = mode() === "chat" ? "/v1/chat/completions" : "/v1/completions";
      const response = await apiFetch(endpoint, {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      const requestId = response.headers.get("x-request-id");
      if (requestId) {
        link.setAttribute("href", requestHref(requestId));
        setText(link, requestId);
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      setText(stats.state, "streaming");
      for await (const ev of sseEvents(response)) {
        if (ev.data === "[DONE]") break;
        const data = JSON.parse(ev.data);
        if (data.error) {
          showError(`${data.error.code ?? data.error.type ?? "error"}: ${data.error.message ?? ""}`);
          continue;
        }
        for (const choice of data.choices || []) {
          const text = mode() === "chat" ? choice.delta?.content : choice.text;
          if (text) {
            const now = performance.now();
            if (firstAt === null) {
              firstAt = now;
              setText(stats.ttft, fmtMs(now - started));
            }
            lastAt = now;
            chunks += 1;
            output.append(text);
            setText(stats.rate, rate(chunks));
          }
          if (choice.finish_reason) finishes[choice.index ?? 0] = choice.finish_reason;
        }
        if (data.usage) usage = data.usage;
      }
      setText(stats.state, "done");
    } catch (err) {
      if (err instanceof AuthNeeded) {
        showError(`An API key is needed: ${err.message}`);
      } else if (controller.signal.aborted) {
        setText(stats.state, "stopped");
      } else {
        showError(err.message || String(err));
        setText(stats.state, "failed");
      }
    } finally {
      send.disabled = false;
      stop.disabled = true;
      controller = null;
    }
    if (finishes.length) setText(stats.finish, finishes.map((x) => x ?? "–").join(", "));
    if (usage) {
      setText(
        stats.usage,
        `prompt ${fmtNumber(usage.prompt_tokens)}, completion ${fmtNumber(usage.completion_tokens)}, total ${fmtNumber(
          usage.total_tokens,
        )} tokens`,
      );
      if (firstAt !== null) setText(stats.rate, rate(usage.completion_tokens));
    }
  }

  stop.addEventListener("click", () => controller?.abort());
  const form = h(
    "form",
    {
      onsubmit: (e) => {
        e.preventDefault();
        if (!controller) run();
      },
    },
    h(
      "div",
      { class: "form-row" },
      h("label", {}, "Model", modelSelect),
      h(
        "div",
        { class: "seg", role: "radiogroup", "aria-label": "mode" },
        h("label", {}, chatRadio, "Chat"),
        h("label", {}, completionRadio, "Completion"),
      ),
      h("label", {}, "Max tokens", maxTokens),
      h("label", {}, "Temperature", temperature),
      h("label", { class: "check", title: "vLLM's ignore_eos: generate max tokens whatever the model says" }, h("span", {}, ignoreEos, " Ignore EOS")),
    ),
    h("div", { class: "form-row" }, h("label", { style: "flex: 1 1 100%" }, promptLabel, prompt)),
    h("div", { class: "form-row" }, send, stop),
  );

  return {
    title: "Playground",
    keep: true, // its stream keeps going while another view is open
    el: h(
      "section",
      {},
      h("h1", {}, "Playground"),
      h("div", { class: "panel" }, form),
      h(
        "div",
        { class: "panel" },
        h("h2", {}, "Output"),
        errorBox,
        output,
        kvList([
          ["State", stats.state],
          ["Time to first token", stats.ttft],
          ["Tokens/s (after the first)", stats.rate],
          ["Finish reason", stats.finish],
          ["Usage", stats.usage],
          ["Request", link],
        ]),
      ),
    ),
    update(snap) {
      const names = snap.models.filter((m) => m.live_workers > 0).map((m) => m.model);
      const want = names.length ? names : [""]; // "": the placeholder saying there is none
      const have = [...modelSelect.options].map((o) => o.value);
      if (want.length === have.length && want.every((name, i) => name === have[i])) return;
      const chosen = modelSelect.value;
      modelSelect.replaceChildren(
        ...want.map((name) => h("option", { value: name }, name || "no model has a live worker")),
      );
      if (names.includes(chosen)) modelSelect.value = chosen;
    },
  };
}

// ---------------------------------------------------------------- routing

const VIEWS = {
  overview: overviewView,
  workers: workersView,
  requests: requestsView,
  batches: batchesView,
  request: (r) => requestView(r.id),
  playground: playgroundView,
};
const kept = new Map(); // views that live on while hidden (the playground)
let current = null;

function parseRoute() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  if (parts[0] === "requests" && parts.length > 1) {
    return { name: "request", id: decodeURIComponent(parts.slice(1).join("/")) };
  }
  return { name: parts[0] in VIEWS && parts[0] !== "request" ? parts[0] : "overview" };
}

function route() {
  const r = parseRoute();
  if (current && !current.view.keep) current.view.destroy?.();
  let view = kept.get(r.name);
  if (!view) {
    view = VIEWS[r.name](r);
    if (view.keep) kept.set(r.name, view);
  }
  current = { route: r, view };
  main.replaceChildren(view.el);
  main.dataset.view = r.name;
  document.title = `${view.title} · streamq`;
  const section = r.name === "request" ? "requests" : r.name;
  for (const a of document.querySelectorAll(".nav a")) a.classList.toggle("active", a.dataset.route === section);
  if (state.snapshot) view.update?.(state.snapshot);
}

window.addEventListener("hashchange", route);
route();
live.connect();
