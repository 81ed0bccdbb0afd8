// What every page shares: its heading block, cards, and the loading/error states of a section.

import { h, replace } from "./dom.js";

export function pageHead(title, description, ...actions) {
  return h("div", { class: "page-head" },
    h("div", {}, h("h1", { tabindex: "-1" }, title), description ? h("p", {}, description) : null),
    actions.length ? h("div", { class: "toolbar" }, actions) : null);
}

export function card(title, ...children) {
  const id = `card-${title.toLowerCase().replace(/[^a-z0-9]+/g, "-")}`;
  return h("section", { class: "card", "aria-labelledby": id }, h("h2", { id }, title), children);
}

/**
 * Fill `target` with what `load()` resolves to, rendered by `render(data)`; "Loading…" first,
 * and on failure the error in words with a Retry button. Returns the promise of the render.
 */
export async function loadInto(target, load, render) {
  if (!target.hasChildNodes()) replace(target, h("p", { class: "loading" }, "Loading…"));
  target.setAttribute("aria-busy", "true");
  try {
    const data = await load();
    replace(target, render(data));
  } catch (error) {
    if (error.status === 401) return;  // the session has ended; main.js shows sign-in
    replace(target, h("div", { class: "alert alert-error", role: "alert" },
      h("p", {}, error.message),
      h("button", { type: "button", class: "button button-secondary button-small",
        onclick: () => { replace(target); loadInto(target, load, render); } }, "Retry")));
  } finally {
    target.removeAttribute("aria-busy");
  }
}

/** A labelled button for a row action ("Delete adapter demo/pirate" to screen readers). */
export function rowButton(label, accessibleLabel, onClick, kind = "secondary") {
  return h("button", {
    type: "button", class: `button button-small button-${kind}`, "aria-label": accessibleLabel, onclick: onClick,
  }, label);
}
