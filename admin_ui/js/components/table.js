// A data table in a scrollable, focusable region. On narrow windows (CSS class `stack`) each
// row becomes a card whose cells are labelled by their column (data-label).

import { h, uid } from "./dom.js";

/**
 * table({caption, columns, rows, empty, rowKey})
 * columns: [{label, cell(row) -> node|string, numeric, className, hideLabel}]
 * rowKey(row): a string set as data-key on each row (tests and lookups use it).
 */
export function table({ caption, columns, rows, empty = "Nothing here yet.", rowKey }) {
  const captionId = uid("caption");
  const head = h("thead", {}, h("tr", {}, columns.map((c) =>
    h("th", { scope: "col", class: c.numeric ? "num" : null },
      c.hideLabel ? h("span", { class: "visually-hidden" }, c.label) : c.label))));
  const body = h("tbody", {});
  if (rows.length === 0) {
    body.append(h("tr", {}, h("td", { class: "empty", colspan: columns.length }, empty)));
  }
  for (const row of rows) {
    body.append(h("tr", { dataset: rowKey ? { key: rowKey(row) } : undefined }, columns.map((c) => {
      const classes = [c.numeric ? "num" : "", c.className || ""].join(" ").trim() || null;
      return h("td", { class: classes, "data-label": c.label }, c.cell(row));
    })));
  }
  const element = h("table", {}, caption ? h("caption", { id: captionId }, caption) : null, head, body);
  return h("div", {
    class: "table-wrap stack", role: "region", tabindex: "0",
    "aria-labelledby": caption ? captionId : null, "aria-label": caption ? null : "Table",
  }, element);
}
