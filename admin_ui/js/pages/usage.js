// Usage: tokens (or requests) per tenant and per adapter over time, as stacked bar charts, from
// the hourly rows of GET /admin/api/usage, with totals and a table per adapter.

import { api } from "../api.js";
import { barChart } from "../components/chart.js";
import { h } from "../components/dom.js";
import { field } from "../components/field.js";
import { formatNumber } from "../components/format.js";
import { loadInto, pageHead } from "../components/page.js";
import { table } from "../components/table.js";

export const title = "Usage";

const HOUR_MS = 3600 * 1000;
const RANGES = {
  "24h": { label: "Last 24 hours", buckets: 24, unit: "hour" },
  "7d": { label: "Last 7 days", buckets: 7, unit: "day" },
  "30d": { label: "Last 30 days", buckets: 30, unit: "day" },
};
const METRICS = {
  total_tokens: { label: "Total tokens", unit: "tokens" },
  prompt_tokens: { label: "Prompt tokens", unit: "tokens" },
  completion_tokens: { label: "Completion tokens", unit: "tokens" },
  num_requests: { label: "Requests", unit: "requests" },
};
const MAX_SERIES = 7;
const BASE_MODEL = "(base model)";

const hourLabel = new Intl.DateTimeFormat(undefined, { hour: "numeric" });
const dayLabel = new Intl.DateTimeFormat(undefined, { month: "short", day: "numeric" });

/** Bucket start times (ms, local time), oldest first, ending with the bucket holding now. */
function bucketStarts(range, now = new Date()) {
  const end = new Date(now);
  if (range.unit === "hour") end.setMinutes(0, 0, 0);
  else end.setHours(0, 0, 0, 0);
  const starts = [];
  for (let i = range.buckets - 1; i >= 0; i -= 1) {
    const start = new Date(end);
    if (range.unit === "hour") start.setTime(end.getTime() - i * HOUR_MS);
    else start.setDate(end.getDate() - i);
    starts.push(start.getTime());
  }
  return starts;
}

function bucketOf(starts, time) {
  for (let i = starts.length - 1; i >= 0; i -= 1) if (time >= starts[i]) return i;
  return -1;
}

/** Series of `metric` per key(row) over the buckets; the largest MAX_SERIES, the rest as "other". */
function seriesBy(rows, starts, metric, key) {
  const byKey = new Map();
  for (const row of rows) {
    const index = bucketOf(starts, new Date(row.hour).getTime());
    if (index < 0) continue;
    const name = key(row);
    if (!byKey.has(name)) byKey.set(name, new Array(starts.length).fill(0));
    byKey.get(name)[index] += row[metric];
  }
  const series = [...byKey].map(([name, values]) => ({ name, values, total: values.reduce((a, b) => a + b, 0) }))
    .filter((s) => s.total > 0)
    .sort((a, b) => b.total - a.total || a.name.localeCompare(b.name));
  if (series.length <= MAX_SERIES) return series;
  const rest = series.slice(MAX_SERIES - 1);
  const other = rest.reduce((acc, s) => acc.map((v, i) => v + s.values[i]), new Array(starts.length).fill(0));
  return [...series.slice(0, MAX_SERIES - 1), { name: `${rest.length} others`, values: other }];
}

const adapterKey = (row) => `${row.tenant}/${row.adapter ?? BASE_MODEL}`;

function totalsTable(rows) {
  const byAdapter = new Map();
  for (const row of rows) {
    const name = adapterKey(row);
    const sum = byAdapter.get(name) ?? { name, tenant: row.tenant, adapter: row.adapter, num_requests: 0, prompt_tokens: 0, completion_tokens: 0, total_tokens: 0 };
    for (const k of ["num_requests", "prompt_tokens", "completion_tokens", "total_tokens"]) sum[k] += row[k];
    byAdapter.set(name, sum);
  }
  const sums = [...byAdapter.values()].sort((a, b) => b.total_tokens - a.total_tokens);
  return table({
    caption: "Totals per adapter in this period",
    rows: sums,
    rowKey: (s) => s.name,
    empty: "No requests in this period.",
    columns: [
      { label: "Tenant", cell: (s) => s.tenant },
      { label: "Adapter", cell: (s) => s.adapter ?? h("span", { class: "muted" }, BASE_MODEL) },
      { label: "Requests", numeric: true, cell: (s) => formatNumber(s.num_requests) },
      { label: "Prompt tokens", numeric: true, cell: (s) => formatNumber(s.prompt_tokens) },
      { label: "Completion tokens", numeric: true, cell: (s) => formatNumber(s.completion_tokens) },
      { label: "Total tokens", numeric: true, cell: (s) => formatNumber(s.total_tokens) },
    ],
  });
}

function report(data, rangeKey, metricKey) {
  const range = RANGES[rangeKey];
  const metric = METRICS[metricKey];
  const starts = bucketStarts(range);
  const labels = starts.map((t) => (range.unit === "hour" ? hourLabel : dayLabel).format(new Date(t)));
  const rows = data.rows.filter((row) => new Date(row.hour).getTime() >= starts[0]);
  const stat = (label, value) => h("div", { class: "stat" }, h("dt", {}, label), h("dd", {}, formatNumber(value)));
  const per = range.unit === "hour" ? "per hour" : "per day";
  const chartCard = (id, heading, key) => h("section", { class: "card", "aria-labelledby": id, id: `${id}-card` },
    h("h2", { id }, heading),
    barChart({
      title: `${metric.label} ${per}, ${heading.toLowerCase()}`,
      description: `${metric.label} ${per} over the ${range.label.toLowerCase()}, stacked ${heading.toLowerCase()}.`,
      labels, series: seriesBy(rows, starts, metricKey, key), unit: metric.unit,
      emptyText: "No requests in this period.",
    }));
  const sum = (k) => rows.reduce((a, row) => a + row[k], 0);
  return [
    h("dl", { class: "stats", "aria-label": "Totals in this period" },
      stat("Requests", sum("num_requests")), stat("Prompt tokens", sum("prompt_tokens")),
      stat("Completion tokens", sum("completion_tokens")), stat("Total tokens", sum("total_tokens"))),
    h("div", { class: "chart-grid" },
      chartCard("usage-by-tenant", "By tenant", (row) => row.tenant),
      chartCard("usage-by-adapter", "By adapter", adapterKey)),
    h("section", { class: "card", "aria-labelledby": "usage-table-title" },
      h("h2", { id: "usage-table-title" }, "Per adapter"), totalsTable(rows)),
  ];
}

export function render(container) {
  const target = h("div", {});
  const range = field({
    label: "Period", name: "range", type: "select", value: "24h",
    options: Object.entries(RANGES).map(([value, r]) => ({ value, label: r.label })),
  });
  const metric = field({
    label: "Show", name: "metric", type: "select", value: "total_tokens",
    options: Object.entries(METRICS).map(([value, m]) => ({ value, label: m.label })),
  });
  const tenant = field({ label: "Tenant", name: "tenant", type: "select", options: [{ value: "", label: "All tenants" }] });

  function refresh() {
    const rangeKey = range.value();
    const since = new Date(bucketStarts(RANGES[rangeKey])[0]).toISOString();
    return loadInto(target, () => api.usage({ since, tenant: tenant.value() || undefined }),
      (data) => report(data, rangeKey, metric.value()));
  }

  for (const control of [range, metric, tenant]) control.input.addEventListener("change", refresh);
  container.append(
    pageHead("Usage", "Tokens in and out per tenant and adapter, recorded per hour as requests finish.",
      range.root, metric.root, tenant.root,
      h("button", { type: "button", class: "button button-secondary", onclick: () => refresh() }, "Refresh")),
    target);
  api.tenants.list().then((tenants) => {
    tenant.setOptions([{ value: "", label: "All tenants" }, ...tenants.map((t) => ({ value: t.name, label: t.name }))]);
  }).catch(() => {});
  refresh();
}
