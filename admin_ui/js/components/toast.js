// Short notices in a polite live region in the top bar (screen readers announce them without
// moving focus; they never cover the page). The newest replaces the one before.

import { h } from "./dom.js";

const TOAST_MS = 6000;

export function toast(message, kind = "info") {
  const region = document.getElementById("toasts");
  const node = h("div", { class: `toast toast-${kind}`, title: message }, message);
  region.replaceChildren(node);
  setTimeout(() => node.remove(), TOAST_MS);
}
