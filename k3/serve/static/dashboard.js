// The dashboard: polls `ui/metrics` every second and shows the current values as tiles and the last two minutes
// as charts. Rates (tokens/s in and out, the prefix-cache hit rate of the last second, speculative acceptance)
// are differences of the engine's counters between two polls; the rest are its gauges. A metric the engine
// does not report shows as "–"; speculative decoding without its counters shows as "not enabled".

import { getJSON } from "./api.js";
import { LineChart } from "./chart.js";

const PERIOD_MS = 1000;
const $ = (id) => document.getElementById(id);

const count = (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US"));
const rate = (v) => (v == null ? "–" : v < 10 ? v.toFixed(1) : Math.round(v).toLocaleString("en-US"));
const percent = (v) => (v == null ? "–" : `${(100 * v).toFixed(v >= 0.995 || v === 0 ? 0 : 1)}%`);
const ratio = (used, total) => (used == null ? "–" : total ? `${count(used)} / ${count(total)}` : count(used));
const share = (part, whole) => (part == null || !whole ? null : part / whole);

// [id, label, value(now) -> text]; `now` holds the metrics plus the rates of the last poll
const TILES = [
  ["running", "requests running", (m) => count(m.requests_running)],
  ["waiting", "requests waiting", (m) => count(m.requests_waiting)],
  ["tokens-out", "tokens/s out", (m) => rate(m.rate_out)],
  ["tokens-in", "tokens/s in (prompt)", (m) => rate(m.rate_in)],
  ["kv", "KV pages on device (used / total)", (m) => ratio(m.kv_pages_used, m.kv_pages_total)],
  ["kv-cached", "KV pages kept by the prefix cache", (m) => count(m.kv_pages_cached)],
  ["cpu-pool", "CPU pool pages (used / total)",
    (m) => (m.cpu_pool_slots_total === 0 ? "not enabled" : ratio(m.cpu_pool_slots_used, m.cpu_pool_slots_total))],
  ["hit-rate", "prefix-cache hit rate (all time)", (m) => percent(share(m.prefix_hits_total, m.prefix_queries_total))],
  ["kda", "KDA state slots (used / total)", (m) => ratio(m.kda_slots_used, m.kda_slots_total)],
  ["spec", "speculative acceptance", (m) => (m.spec_draft_tokens_total == null ? "not enabled"
    : percent(share(m.spec_accepted_tokens_total, m.spec_draft_tokens_total)))],
  ["finished", "requests finished", (m) => count(m.requests_finished_total)],
  ["generated", "tokens generated", (m) => count(m.generation_tokens_total)],
  ["ttft", "mean time to first token", (m) => (m.time_to_first_token_seconds_count
    ? `${Math.round(1000 * m.time_to_first_token_seconds_sum / m.time_to_first_token_seconds_count)} ms` : "–")],
  ["preempted", "preemptions", (m) => count(m.preemptions_total)],
  ["rejected", "admission rejections", (m) => count(m.admission_rejections_total)],
];

// [id, title, series names, options, values(now) -> [number | null], off(now) -> reason it has no chart]
const CHARTS = [
  ["requests", "Requests", ["running", "waiting"], {}, (m) => [m.requests_running, m.requests_waiting]],
  ["tokens", "Tokens per second", ["in (prompt)", "out (generated)"], {}, (m) => [m.rate_in, m.rate_out]],
  ["kv", "KV pages on the device", ["used by requests", "kept by the prefix cache"], { maxKey: "kv_pages_total" },
    (m) => [m.kv_pages_used, m.kv_pages_cached]],
  ["cpu-pool", "KV pages in the CPU pool", ["used"], { maxKey: "cpu_pool_slots_total" },
    (m) => [m.cpu_pool_slots_used], (m) => (m.cpu_pool_slots_total === 0 ? "not enabled (--cpu-pool-bytes)" : "")],
  ["hit-rate", "Prefix-cache hit rate (prompt tokens)", ["last second", "all time"], { max: 1, format: percent },
    (m) => [m.hit_rate_now, share(m.prefix_hits_total, m.prefix_queries_total)]],
  ["kda", "KDA state slots", ["used"], { maxKey: "kda_slots_total" }, (m) => [m.kda_slots_used]],
  ["spec", "Speculative acceptance", ["last second", "all time"], { max: 1, format: percent },
    (m) => [m.spec_now, share(m.spec_accepted_tokens_total, m.spec_draft_tokens_total)],
    (m) => (m.spec_draft_tokens_total == null ? "not enabled" : "")],
];

const charts = {};
let previous = null;
let inFlight = false;

function build() {
  for (const [id, label] of TILES) {
    const tile = document.createElement("div");
    tile.className = "tile";
    tile.id = `tile-${id}`;
    tile.innerHTML = '<div class="label"></div><div class="value">–</div>';
    tile.querySelector(".label").textContent = label;
    $("tiles").append(tile);
  }
  for (const [id, title] of CHARTS) {
    const card = document.createElement("div");
    card.className = "card";
    card.id = `chart-${id}`;
    card.innerHTML = '<h2></h2><div class="legend"></div><canvas></canvas><div class="off" hidden></div>';
    card.querySelector("h2").textContent = title;
    $("charts").append(card);
  }
}

function delta(m, p, key) {
  return p && m[key] != null && p[key] != null ? Math.max(0, m[key] - p[key]) : null;
}

// the metrics of this poll plus the rates since the last one
function withRates(m, time) {
  const now = { ...m };
  const p = previous?.metrics;
  const dt = previous ? time - previous.time : 0;
  if (dt > 0) {
    const d = (key) => delta(m, p, key);
    now.rate_in = d("prompt_tokens_total") == null ? null : d("prompt_tokens_total") / dt;
    now.rate_out = d("generation_tokens_total") == null ? null : d("generation_tokens_total") / dt;
    now.hit_rate_now = d("prefix_queries_total") ? d("prefix_hits_total") / d("prefix_queries_total") : null;
    now.spec_now = d("spec_draft_tokens_total") ? d("spec_accepted_tokens_total") / d("spec_draft_tokens_total") : null;
  }
  return now;
}

function show(now, time) {
  for (const [id, , value] of TILES) $(`tile-${id}`).querySelector(".value").textContent = value(now);
  for (const [id, , names, options, values, off] of CHARTS) {
    const card = $(`chart-${id}`);
    const reason = off ? off(now) : "";
    card.querySelector(".off").hidden = !reason;
    card.querySelector(".off").textContent = reason;
    card.querySelector("canvas").hidden = Boolean(reason);
    if (reason) continue;
    if (!charts[id]) {
      const max = options.maxKey ? now[options.maxKey] || null : options.max ?? null;
      charts[id] = new LineChart(card.querySelector("canvas"), card.querySelector(".legend"),
                                 names.map((name) => ({ name })), { max, format: options.format });
    }
    charts[id].push(time, values(now).map((v) => (v == null ? null : v)));
  }
}

async function poll() {
  if (inFlight) return;
  inFlight = true;
  try {
    const { time, metrics } = await getJSON("ui/metrics");
    show(withRates(metrics, time), time);
    previous = { time, metrics };
    $("status").textContent = `live · updated ${new Date(time * 1000).toLocaleTimeString()}`;
    $("status").classList.remove("error-text");
  } catch (e) {
    $("status").textContent = `no metrics: ${e.message}`;
    $("status").classList.add("error-text");
  } finally {
    inFlight = false;
  }
}

build();
poll();
setInterval(poll, PERIOD_MS);
window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.draw()));
