// Short notices in a polite live region (screen readers announce them without moving focus).

import { h } from "./dom.js";

const TOAST_MS = 6000;

export function toast(message, kind = "info") {
  const region = document.getElementById("toasts");
  const node = h("div", { class: `toast toast-${kind}` }, message);
  region.append(node);
  setTimeout(() => node.remove(), TOAST_MS);
}
