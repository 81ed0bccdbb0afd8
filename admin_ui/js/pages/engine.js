// Engine: requests running, waiting and swapped, per tenant with its share of the service over
// time, KV blocks, the device pool's pages by kind (KV, adapters, free), the prefix cache and relay decode, preemptions and swapping, adapters in device slots and in the host tier, the generation rate, and the engine's options and start-up (memory plan, CUDA graphs),
// and, when prefill and decode are disaggregated, each side's queue and KV blocks and the KV sent between them,
// polled from GET /admin/api/engine while the page is open and visible.

import { api } from "../api.js";
import { lineChart } from "../components/chart.js";
import { h, replace } from "../components/dom.js";
import { formatBytes, formatDuration, formatNumber, formatRate, shortHash } from "../components/format.js";
import { pageHead } from "../components/page.js";
import { table } from "../components/table.js";

export const title = "Engine";

export const POLL_MS = 1500;
const HISTORY = 80;  // samples kept for the charts: two minutes at POLL_MS

const STATS = [
  { key: "running", label: "Running", value: (s) => formatNumber(s.num_requests_running) },
  { key: "waiting", label: "Waiting", value: (s) => formatNumber(s.num_requests_waiting) },
  { key: "in-flight", label: "In flight (server)", value: (s) => formatNumber(s.num_requests_in_flight) },
  {
    key: "kv", label: "KV blocks in use", value: (s) => formatNumber(s.kv_blocks_used),
    sub: (s) => `of ${formatNumber(s.kv_blocks_total)} (${(100 * s.kv_cache_usage).toFixed(1)}%)`,
    meter: (s) => s.kv_cache_usage,
  },
  {
    key: "pool", label: "Device pool", value: (s) => `${formatNumber(poolTotal(s))} pages`,
    sub: (s) => `of ${formatBytes(s.pool_page_bytes)}: ${formatNumber(s.pool_pages.kv ?? 0)} KV, `
      + `${formatNumber(s.pool_pages.adapters ?? 0)} adapters, ${formatNumber(s.pool_pages.free ?? 0)} free`,
    meter: (s) => (poolTotal(s) ? 1 - (s.pool_pages.free ?? 0) / poolTotal(s) : 0),
  },
  { key: "tokens-per-second", label: "Tokens per second", value: (s) => formatRate(s.generation_tokens_per_second) },
  { key: "generated", label: "Tokens generated", value: (s) => formatNumber(s.num_generated_tokens), sub: () => "since start" },
  {
    key: "resident", label: "Adapters resident", value: (s) => formatNumber(s.adapters_resident.length),
    sub: (s) => `of at most ${formatNumber(s.num_adapter_slots)} (${s.max_loras ? "--max-loras" : "what the pool holds"}); `
      + `${formatNumber(s.num_adapter_evictions)} evicted since start`,
    meter: (s) => (s.num_adapter_slots ? s.adapters_resident.length / s.num_adapter_slots : 0),
  },
  {
    key: "host", label: "Adapters in host tier", value: (s) => formatNumber(s.num_adapters_on_host),
    sub: (s) => `${formatBytes(s.host_tier_bytes)} of ${formatBytes(s.max_host_tier_bytes)}`,
    meter: (s) => (s.max_host_tier_bytes ? s.host_tier_bytes / s.max_host_tier_bytes : 0),
  },
  {
    key: "adapter-loads", label: "Adapter loads", value: (s) => formatNumber(s.num_adapter_slot_loads),
    sub: (s) => `into slots; ${formatNumber(s.num_adapter_host_loads)} read into the host tier; `
      + `mean wait for an adapter ${meanWait(s.adapter_wait)}`,
  },
  {
    key: "preemptions", label: "Preemptions", value: (s) => formatNumber(s.num_preemptions),
    sub: (s) => `since start: ${formatNumber(byMode(s.preemptions, "swap"))} swapped, `
      + `${formatNumber(byMode(s.preemptions, "recompute"))} recomputed`,
  },
  {
    key: "swapped", label: "Requests swapped out",
    value: (s) => formatNumber(Object.values(s.requests_by_tenant).reduce((n, t) => n + t.swapped, 0)),
    sub: (s) => `host pool ${formatNumber(s.host_pool_blocks_used)} of ${formatNumber(s.host_pool_blocks)} blocks; `
      + `${formatBytes(s.swap_bytes_out)} out, ${formatBytes(s.swap_bytes_in)} in since start`,
    meter: (s) => (s.host_pool_blocks ? s.host_pool_blocks_used / s.host_pool_blocks : 0),
  },
  {
    key: "prefix-cache", label: "Prefix cache hits",
    value: (s) => (s.prefix_cache_queries ? `${(100 * s.prefix_cache_hits / s.prefix_cache_queries).toFixed(1)}%` : "–"),
    sub: (s) => `${formatNumber(s.prefix_cache_hits)} of ${formatNumber(s.prefix_cache_queries)} prompt tokens since start; `
      + `${formatNumber(s.kv_blocks_shared)} KV blocks shared now`,
    meter: (s) => (s.prefix_cache_queries ? s.prefix_cache_hits / s.prefix_cache_queries : 0),
  },
  {
    key: "relay", label: "Relay decode steps", value: (s) => formatNumber(s.relay_steps),
    sub: (s) => (s.relay_steps
      ? `${(s.relay_groups / s.relay_steps).toFixed(1)} groups, ${(s.relay_members / s.relay_steps).toFixed(1)} requests a step`
      : "no shared prefix read once per group yet"),
  },
];

function poolTotal(state) {
  return Object.values(state.pool_pages ?? {}).reduce((n, c) => n + c, 0);
}

function meanWait(wait) {
  if (!wait || !wait.num_requests) return "–";
  const mean = wait.total_seconds / wait.num_requests;
  return mean < 10 ? `${(1000 * mean).toFixed(mean < 0.01 ? 1 : 0)} ms` : formatDuration(mean);
}

function byMode(preemptions, mode) {
  return Object.entries(preemptions).filter(([kind]) => kind.endsWith(`:${mode}`)).reduce((n, [, c]) => n + c, 0);
}

function tenantTable(state) {
  const rows = Object.entries(state.requests_by_tenant).map(([name, t]) => ({ name, ...t }));
  return table({
    caption: "Requests and service per tenant (service: prompt tokens + 2 x generated tokens, over the weight)",
    rows, rowKey: (t) => t.name,
    empty: "No tenant has requests in the engine yet.",
    columns: [
      { label: "Tenant", cell: (t) => t.name },
      { label: "Weight", cell: (t) => String(t.weight) },
      { label: "Running", cell: (t) => formatNumber(t.running) },
      { label: "Waiting", cell: (t) => formatNumber(t.waiting) },
      { label: "Swapped", cell: (t) => formatNumber(t.swapped) },
      { label: "Service", cell: (t) => formatNumber(Math.round(t.service)) },
    ],
  });
}

/** Each tenant's share of the weighted service given between consecutive samples, in percent:
 * equal shares under contention are what fair scheduling aims at. */
function shareSeries(history) {
  const tenants = [...new Set(history.flatMap((s) => Object.keys(s.state.requests_by_tenant)))].sort();
  const service = (sample, tenant) => sample.state.requests_by_tenant[tenant]?.service ?? 0;
  return tenants.map((tenant) => ({
    name: tenant,
    values: history.map((sample, i) => {
      if (i === 0) return 0;
      const gained = (t) => Math.max(0, service(sample, t) - service(history[i - 1], t));
      const total = tenants.reduce((sum, t) => sum + gained(t), 0);
      return total ? (100 * gained(tenant)) / total : 0;
    }),
  }));
}

function statTiles() {
  const tiles = {};
  const list = h("dl", { class: "stats", "aria-label": "Engine figures" }, STATS.map((stat) => {
    const value = h("span", { dataset: { stat: stat.key } }, "—");
    const sub = stat.sub ? h("span", { class: "sub" }) : null;
    const meterFill = stat.meter ? h("span", { class: "meter-fill" }) : null;
    tiles[stat.key] = { value, sub, meterFill };
    return h("div", { class: "stat" }, h("dt", {}, stat.label), h("dd", {}, value, sub,
      meterFill ? h("span", { class: "meter", "aria-hidden": "true" }, meterFill) : null));
  }));
  return {
    list,
    update(state) {
      for (const stat of STATS) {
        const tile = tiles[stat.key];
        tile.value.textContent = stat.value(state);
        if (tile.sub) tile.sub.textContent = stat.sub(state);
        if (tile.meterFill) tile.meterFill.style.width = `${Math.min(100, 100 * stat.meter(state)).toFixed(1)}%`;
      }
    },
  };
}

function residentTable(state) {
  return table({
    caption: `${state.adapters_resident.length} adapters resident in the device pool (at most ${state.num_adapter_slots})`,
    rows: state.adapters_resident,
    rowKey: (a) => a.digest,
    empty: "No adapter is in a device slot now. Adapters load on first use.",
    columns: [
      { label: "Digest", cell: (a) => h("code", { title: a.digest }, shortHash(a.digest)) },
      { label: "Adapters (tenant/name)", cell: (a) => (a.names.length ? a.names.join(", ") : h("span", { class: "muted" }, "none now (deleted)")) },
      { label: "Device memory", cell: (a) => formatBytes(a.device_bytes) },
    ],
  });
}

function sidesTable(state) {
  const rows = Object.entries(state.sides).map(([name, side]) => ({ name, ...side }));
  const sent = state.kv_transfers;
  const rate = sent && sent.seconds ? `${(sent.bytes_per_second / 1e9).toFixed(2)} GB/s` : "–";
  return h("div", {},
    table({
      caption: "Prefill and decode sides (the figures above are both sides' together)",
      rows, rowKey: (side) => side.name,
      columns: [
        { label: "Side", cell: (side) => side.name },
        { label: "Running", cell: (side) => formatNumber(side.num_requests_running) },
        { label: "Waiting", cell: (side) => formatNumber(side.num_requests_waiting) },
        { label: "KV blocks in use", cell: (side) => `${formatNumber(side.kv_blocks_used)} of ${formatNumber(side.kv_blocks_total)}` },
        { label: "Preemptions", cell: (side) => formatNumber(side.num_preemptions) },
      ],
    }),
    h("p", { class: "muted", dataset: { role: "kv-transfers" } }, sent
      ? `KV sent from prefill to decode since start: ${formatNumber(sent.num_transfers)} `
        + `transfer${sent.num_transfers === 1 ? "" : "s"}, `
        + `${formatNumber(sent.num_blocks)} blocks, ${formatBytes(sent.num_bytes)}, ${rate}.`
      : "No KV transfers yet."));
}

function optionsTable(state) {
  const rows = Object.entries(state.options).map(([name, value]) => ({
    name: `--${name.replaceAll("_", "-")}`, value: value === null ? "default (sized at start-up)" : String(value),
  }));
  const memory = state.memory;
  const graphs = state.cuda_graphs;
  const startup = [
    `one pool of ${formatNumber(memory.num_pool_blocks)} pages of ${formatBytes(memory.kv_block_bytes)} `
      + `(${formatBytes(memory.num_pool_blocks * memory.kv_block_bytes)}) for KV blocks and adapters`,
    `up to ${formatNumber(memory.num_lora_slots)} adapter slots of ${formatNumber(memory.slot_blocks)} pages `
      + `(${formatBytes(memory.lora_slot_bytes)})`,
    graphs ? `${formatNumber(graphs.num_graphs)} decode graphs captured in ${graphs.seconds.toFixed(1)} s, `
      + `holding ${formatBytes(graphs.pool_bytes + graphs.output_bytes)}` : "no CUDA graphs (eager steps)",
  ].join("; ");
  return h("div", {},
    h("p", { class: "muted", dataset: { role: "startup" } }, `At start-up: ${startup}.`),
    table({
      caption: "Engine options (the flags of loraplex serve)",
      rows, rowKey: (o) => o.name,
      columns: [
        { label: "Option", cell: (o) => h("code", {}, o.name) },
        { label: "Value", cell: (o) => o.value },
      ],
    }));
}

export function render(container) {
  const history = [];
  const tiles = statTiles();
  const summary = h("p", { class: "muted", dataset: { role: "summary" } }, "Loading…");
  const alert = h("div", { class: "alert alert-error", role: "alert", hidden: true });
  const rateChart = h("div", {});
  const requestChart = h("div", {});
  const resident = h("div", {});
  const shareChart = h("div", {});
  const tenants = h("div", {});
  const sides = h("div", {});
  const sidesCard = h("section", { class: "card", "aria-labelledby": "sides-title", hidden: true },
    h("h2", { id: "sides-title" }, "Prefill and decode"), sides);
  const options = h("div", {});
  const liveDot = h("span", { class: "live-dot", "aria-hidden": "true" });
  const liveText = h("span", {}, `Live, every ${POLL_MS / 1000} s`);
  const pause = h("button", { type: "button", class: "button button-secondary", "aria-pressed": "false" }, "Pause updates");
  let isPaused = false;
  let timer = null;
  let isStopped = false;

  function draw(state) {
    tiles.update(state);
    const alive = state.is_alive ? "running" : "stopped";
    summary.textContent = `${state.model} on ${state.device} (${state.dtype}), engine ${alive}, `
      + `context up to ${formatNumber(state.max_model_len)} tokens, up ${formatDuration(state.uptime_s)}.`;
    const labels = history.map((s) => s.at);
    replace(rateChart, lineChart({
      title: "Generated tokens per second, last two minutes",
      labels, series: [{ name: "tokens/s", values: history.map((s) => s.state.generation_tokens_per_second) }],
      yFormat: (v) => formatRate(v),
    }));
    replace(requestChart, lineChart({
      title: "Requests running and waiting, last two minutes",
      labels, series: [
        { name: "running", values: history.map((s) => s.state.num_requests_running) },
        { name: "waiting", values: history.map((s) => s.state.num_requests_waiting) },
      ],
      isInteger: true,
    }));
    replace(shareChart, lineChart({
      title: "Share of weighted service per tenant (%), last two minutes",
      labels, series: shareSeries(history), yFormat: (v) => `${Math.round(v)}%`,
    }));
    replace(tenants, tenantTable(state));
    replace(resident, residentTable(state));
    sidesCard.hidden = !state.sides;
    if (state.sides) replace(sides, sidesTable(state));
    replace(options, optionsTable(state));
  }

  async function poll() {
    timer = null;
    if (isStopped) return;
    if (!isPaused && !document.hidden) {
      try {
        const state = await api.engine();
        if (isStopped) return;
        history.push({ at: new Date().toLocaleTimeString(), state });
        if (history.length > HISTORY) history.shift();
        alert.hidden = true;
        draw(state);
      } catch (error) {
        if (error.status === 401 || isStopped) return;
        alert.textContent = `Could not read the engine state: ${error.message} Retrying…`;
        alert.hidden = false;
      }
    }
    if (!isStopped) timer = setTimeout(poll, POLL_MS);
  }

  pause.addEventListener("click", () => {
    isPaused = !isPaused;
    pause.setAttribute("aria-pressed", String(isPaused));
    pause.textContent = isPaused ? "Resume updates" : "Pause updates";
    liveDot.classList.toggle("paused", isPaused);
    liveText.textContent = isPaused ? "Paused" : `Live, every ${POLL_MS / 1000} s`;
  });

  container.append(
    pageHead("Engine", null, h("span", { class: "live" }, liveDot, liveText), pause),
    summary, alert, tiles.list,
    h("div", { class: "chart-grid" },
      h("section", { class: "card", "aria-labelledby": "rate-title" }, h("h2", { id: "rate-title" }, "Generation rate"), rateChart),
      h("section", { class: "card", "aria-labelledby": "requests-title" }, h("h2", { id: "requests-title" }, "Requests"), requestChart)),
    h("section", { class: "card", "aria-labelledby": "tenants-title" },
      h("h2", { id: "tenants-title" }, "Tenants"), shareChart, tenants),
    sidesCard,
    h("section", { class: "card", "aria-labelledby": "resident-title" },
      h("h2", { id: "resident-title" }, "Adapters on the device"), resident),
    h("section", { class: "card", "aria-labelledby": "options-title" },
      h("h2", { id: "options-title" }, "Options and start-up"), options));
  poll();
  return () => {
    isStopped = true;
    if (timer) clearTimeout(timer);
  };
}
