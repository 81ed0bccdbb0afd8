// Number, size and date formatting shared by the pages.

const numberFormat = new Intl.NumberFormat(undefined);
const dateFormat = new Intl.DateTimeFormat(undefined, { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
const thisYearFormat = new Intl.DateTimeFormat(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
const yearDay = new Intl.DateTimeFormat(undefined, { year: "numeric", month: "short", day: "numeric" });
const thisYearDay = new Intl.DateTimeFormat(undefined, { month: "short", day: "numeric" });

export function formatNumber(value) {
  return value === null || value === undefined ? "—" : numberFormat.format(value);
}

export function formatRate(value) {
  if (!Number.isFinite(value)) return "—";
  return value >= 100 ? numberFormat.format(Math.round(value)) : value.toFixed(1);
}

/** A limit: null means unlimited. */
export function formatLimit(value) {
  return value === null || value === undefined ? "unlimited" : numberFormat.format(value);
}

export function formatBytes(bytes) {
  if (!Number.isFinite(bytes)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(value >= 100 ? 0 : 1)} ${units[unit]}`;
}

export function formatDate(iso) {
  if (!iso) return "—";
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return iso;
  return (date.getFullYear() === new Date().getFullYear() ? thisYearFormat : dateFormat).format(date);
}

/** The day only, with the full date and time as a tooltip. */
export function formatDay(iso) {
  if (!iso) return "—";
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return iso;
  const format = date.getFullYear() === new Date().getFullYear() ? thisYearDay : yearDay;
  const node = document.createElement("time");
  node.dateTime = iso;
  node.title = formatDate(iso);
  node.textContent = format.format(date);
  return node;
}

export function formatDuration(seconds) {
  const s = Math.floor(seconds);
  const days = Math.floor(s / 86400);
  const hours = Math.floor((s % 86400) / 3600);
  const minutes = Math.floor((s % 3600) / 60);
  if (days) return `${days} d ${hours} h`;
  if (hours) return `${hours} h ${minutes} min`;
  if (minutes) return `${minutes} min ${s % 60} s`;
  return `${s} s`;
}

/** How many characters of an adapter's digest are shown (as `loraplex adapter list` does). */
export const DIGEST_CHARS = 16;

/** The first characters of a hex digest, for telling adapters apart. */
export function shortHash(hex, length = DIGEST_CHARS) {
  return hex ? hex.slice(0, length) : "—";
}
