// Charts drawn as SVG: stacked bars (usage over time) and lines (live engine figures). Each
// chart has a text title and description for screen readers, a legend with each series' total,
// and (bars) a data table to read the exact values.

import { h, svg, uid } from "./dom.js";
import { formatNumber } from "./format.js";
import { table } from "./table.js";

// Okabe–Ito colours (distinguishable with colour-blindness), darkened where too light on white.
export const PALETTE = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#7a5195", "#5f6b7a"];

const WIDTH = 520;
const MARGIN = { top: 12, right: 14, bottom: 30, left: 48 };

function compact(value) {
  const abs = Math.abs(value);
  if (abs >= 1e9) return `${+(value / 1e9).toFixed(1)}G`;
  if (abs >= 1e6) return `${+(value / 1e6).toFixed(1)}M`;
  if (abs >= 1e3) return `${+(value / 1e3).toFixed(1)}k`;
  return `${+value.toFixed(abs < 10 && abs % 1 ? 1 : 0)}`;
}

/** A round maximum above `value` and the ticks up to it. */
function scale(value, { numTicks = 4, isInteger = false } = {}) {
  if (!(value > 0)) return { max: 1, ticks: [0, 1] };
  const rough = value / numTicks;
  const magnitude = 10 ** Math.floor(Math.log10(rough));
  let step = [1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= rough);
  if (isInteger) step = Math.max(1, Math.round(step));
  const max = Math.ceil(value / step) * step;
  const ticks = [];
  for (let t = 0; t <= max + step / 2; t += step) ticks.push(t);
  return { max, ticks };
}

function axes(height, yScale, yFormat) {
  const plotHeight = height - MARGIN.top - MARGIN.bottom;
  const y = (v) => MARGIN.top + plotHeight - (v / yScale.max) * plotHeight;
  const nodes = yScale.ticks.map((t) => [
    svg("line", { class: "grid-line", x1: MARGIN.left, x2: WIDTH - MARGIN.right, y1: y(t), y2: y(t) }),
    svg("text", { x: MARGIN.left - 6, y: y(t) + 4, "text-anchor": "end", text: yFormat(t) }),
  ]);
  nodes.push(svg("line", {
    class: "axis-line", x1: MARGIN.left, x2: WIDTH - MARGIN.right, y1: y(0), y2: y(0),
  }));
  return { nodes, y };
}

function xLabels(labels, xCenter, height, maxLabels = 6) {
  const every = Math.max(1, Math.ceil(labels.length / maxLabels));
  return labels.map((label, i) => (i % every === 0
    ? svg("text", { x: xCenter(i), y: height - 8, "text-anchor": "middle", text: label })
    : null));
}

function legend(series, unit) {
  return h("ul", { class: "legend" }, series.map((s) => h("li", {
    dataset: { series: s.name, total: String(s.total) },
  },
  h("span", { class: "swatch", style: null, "aria-hidden": "true", dataset: { color: s.color } }),
  h("span", {}, s.name),
  h("span", { class: "total" }, `${formatNumber(s.total)}${unit ? ` ${unit}` : ""}`))));
}

function paintSwatches(root) {
  // Colours are set through the CSSOM: the page's CSP forbids inline style attributes.
  for (const swatch of root.querySelectorAll(".swatch")) swatch.style.background = swatch.dataset.color;
}

function withColours(series) {
  return series.map((s, i) => ({
    ...s, color: s.color || PALETTE[i % PALETTE.length], total: s.values.reduce((a, b) => a + b, 0),
  }));
}

/**
 * barChart({title, description, labels, series, unit, height})
 * labels: one per bucket; series: [{name, values}] with one value per bucket, stacked.
 */
export function barChart({ title, description, labels, series, unit = "", height = 240, emptyText = "No data in this period." }) {
  const titleId = uid("chart-title");
  const descId = uid("chart-desc");
  const coloured = withColours(series);
  const grandTotal = coloured.reduce((a, s) => a + s.total, 0);
  const figure = h("figure", { class: "chart-figure", dataset: { total: String(grandTotal) } });
  if (grandTotal === 0) {
    figure.append(h("p", { class: "chart-empty" }, emptyText));
    return figure;
  }
  const sums = labels.map((_, i) => coloured.reduce((a, s) => a + s.values[i], 0));
  const yScale = scale(Math.max(...sums), { isInteger: true });
  const { nodes, y } = axes(height, yScale, compact);
  const plotWidth = WIDTH - MARGIN.left - MARGIN.right;
  const slot = plotWidth / labels.length;
  const barWidth = Math.max(1, Math.min(36, slot * 0.7));
  const xCenter = (i) => MARGIN.left + slot * (i + 0.5);
  const bars = [];
  labels.forEach((label, i) => {
    let base = 0;
    for (const s of coloured) {
      const value = s.values[i];
      if (!value) continue;
      const top = y(base + value);
      bars.push(svg("rect", {
        x: xCenter(i) - barWidth / 2, y: top, width: barWidth, height: Math.max(1, y(base) - top),
        fill: s.color, "data-series": s.name, "data-bucket": label, "data-value": value,
      }, svg("title", { text: `${s.name}, ${label}: ${formatNumber(value)}${unit ? ` ${unit}` : ""}` })));
      base += value;
    }
  });
  const chart = svg("svg", {
    class: "chart", viewBox: `0 0 ${WIDTH} ${height}`, role: "img",
    "aria-labelledby": `${titleId} ${descId}`, preserveAspectRatio: "xMidYMid meet",
  },
  svg("title", { id: titleId, text: title }),
  svg("desc", { id: descId, text: description || `${coloured.length} series, ${formatNumber(grandTotal)} ${unit} in all.` }),
  nodes, bars, xLabels(labels, xCenter, height));
  const dataTable = table({
    caption: `${title}: values per period`,
    columns: [
      { label: "Period", cell: (row) => row.label },
      ...coloured.map((s) => ({ label: s.name, numeric: true, cell: (row) => formatNumber(s.values[row.index]) })),
    ],
    rows: labels.map((label, index) => ({ label, index })).filter((row) => sums[row.index] > 0),
  });
  figure.append(chart, legend(coloured, unit),
    h("details", { class: "data-table" }, h("summary", {}, "Show the numbers"), dataTable));
  paintSwatches(figure);
  return figure;
}

/**
 * lineChart({title, series, labels, yFormat, height, minMax, isInteger})
 * series: [{name, values}] over the same points (oldest first).
 */
export function lineChart({ title, description, labels, series, yFormat = compact, height = 190, minMax = 1, isInteger = false }) {
  const titleId = uid("chart-title");
  const descId = uid("chart-desc");
  const coloured = withColours(series);
  const peak = Math.max(minMax, ...coloured.flatMap((s) => s.values));
  const yScale = scale(peak, { isInteger });
  const { nodes, y } = axes(height, yScale, yFormat);
  const plotWidth = WIDTH - MARGIN.left - MARGIN.right;
  const count = Math.max(2, labels.length);
  const x = (i) => MARGIN.left + (plotWidth * i) / (count - 1);
  const lines = coloured.map((s) => {
    const points = s.values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    return svg("polyline", {
      points, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-linejoin": "round",
      "data-series": s.name, "data-last": s.values.at(-1) ?? 0,
    });
  });
  const chart = svg("svg", {
    class: "chart", viewBox: `0 0 ${WIDTH} ${height}`, role: "img", "aria-labelledby": `${titleId} ${descId}`,
  },
  svg("title", { id: titleId, text: title }),
  svg("desc", { id: descId, text: description || title }),
  nodes, lines,
  labels.length > 1 ? svg("text", { x: x(0), y: height - 8, "text-anchor": "start", text: labels[0] }) : null,
  svg("text", { x: x(count - 1), y: height - 8, "text-anchor": "end", text: "now" }));
  const figure = h("figure", { class: "chart-figure" }, chart, h("ul", { class: "legend" }, coloured.map((s) => h("li", {},
    h("span", { class: "swatch", "aria-hidden": "true", dataset: { color: s.color } }),
    h("span", {}, s.name),
    h("span", { class: "total" }, `now ${yFormat(s.values.at(-1) ?? 0)}`)))));
  paintSwatches(figure);
  return figure;
}
