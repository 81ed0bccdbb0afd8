// Building DOM nodes without HTML strings: text from the API only ever lands in text nodes.

/**
 * h("button", {class: "button", onclick: fn, "aria-label": "Delete"}, "Delete")
 * Attributes: `class`, `text`, `dataset` (object), `on<event>` (listener), `true`/`false`/null
 * for boolean attributes; anything else is set with setAttribute. Children: nodes, strings,
 * numbers, arrays of them; null and false are skipped.
 */
export function h(tag, attrs = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") element.className = value;
    else if (name === "text") element.textContent = value;
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name.startsWith("on") && typeof value === "function") {
      element.addEventListener(name.slice(2), value);
    } else if (value === true) element.setAttribute(name, "");
    else element.setAttribute(name, String(value));
  }
  append(element, children);
  return element;
}

/** An SVG element (charts). */
export function svg(tag, attrs = {}, ...children) {
  const element = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") element.textContent = value;
    else element.setAttribute(name, String(value));
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replace all children of `element`. */
export function replace(element, ...children) {
  element.replaceChildren();
  append(element, children);
  return element;
}

let nextId = 0;

/** A document-unique id for label/aria wiring. */
export function uid(prefix = "id") {
  nextId += 1;
  return `${prefix}-${nextId}`;
}
