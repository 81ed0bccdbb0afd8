// A form control with its label, an optional hint and an error message next to it
// (aria-describedby points at both; aria-invalid marks the control while it has an error).

import { h, uid } from "./dom.js";

/**
 * field({label, name, type, value, hint, required, options, attrs, wide})
 * type: any <input> type, "select" (options: [{value, label}]), "textarea" or "checkbox".
 * Returns {root, input, name, setError(message), clearError(), value(), setOptions(options)}.
 */
export function field({ label, name, type = "text", value, hint, required = false, options = [], attrs = {}, wide = false }) {
  const id = uid(`field-${name}`);
  const hintId = `${id}-hint`;
  const errorId = `${id}-error`;
  let input;
  if (type === "select") {
    input = h("select", { id, name, required, ...attrs });
  } else if (type === "textarea") {
    input = h("textarea", { id, name, required, ...attrs });
    if (value !== undefined) input.defaultValue = value;
  } else {
    input = h("input", { id, name, type, required, ...attrs });
    // Defaults (not just values): form.reset() returns to them.
    if (type === "checkbox") input.defaultChecked = Boolean(value);
    else if (value !== undefined && value !== null) input.defaultValue = String(value);
  }
  input.setAttribute("aria-describedby", hint ? `${hintId} ${errorId}` : errorId);
  // `required` tells assistive technology that the field is required; the label stays the name.
  const labelNode = h("label", { for: id }, label);
  const hintNode = hint ? h("span", { class: "hint", id: hintId }, hint) : null;
  const errorNode = h("span", { class: "error", id: errorId });
  const root = type === "checkbox"
    ? h("div", { class: "field" }, h("div", { class: "check" }, input, labelNode), hintNode, errorNode)
    : h("div", { class: wide ? "field field-wide" : "field" }, labelNode, input, hintNode, errorNode);

  const control = {
    root, input, name,
    setError(message) {
      errorNode.textContent = message;
      input.setAttribute("aria-invalid", "true");
    },
    clearError() {
      errorNode.textContent = "";
      input.removeAttribute("aria-invalid");
    },
    value() {
      if (type === "checkbox") return input.checked;
      if (type === "file") return input.files[0] ?? null;
      return input.value.trim();
    },
    setOptions(choices, selected) {
      const keep = selected ?? input.value;
      input.replaceChildren(...choices.map((c) => h("option", { value: c.value }, c.label)));
      if (choices.some((c) => c.value === keep)) input.value = keep;
    },
  };
  if (type === "select") control.setOptions(options, value);
  input.addEventListener("input", () => control.clearError());
  return control;
}

export const NAME_PATTERN = /^[A-Za-z0-9._-]{1,64}$/;
export const NAME_HINT = "1 to 64 letters, digits, dots, dashes or underscores.";

/** Check required fields and names before sending; returns true when all are fine. */
export function checkFields(fields, { names = [] } = {}) {
  let isValid = true;
  for (const f of fields) {
    f.clearError();
    const value = f.value();
    if (f.input.required && (value === "" || value === null)) {
      f.setError(f.input.type === "file" ? "Choose a file." : "This field is required.");
      isValid = false;
    } else if (names.includes(f) && value && !NAME_PATTERN.test(value)) {
      f.setError(`Not a valid name. ${NAME_HINT}`);
      isValid = false;
    } else if (f.input.type === "number" && f.input.validity.badInput) {
      f.setError("Enter a number.");
      isValid = false;
    }
  }
  if (!isValid) fields.find((f) => f.input.getAttribute("aria-invalid") === "true")?.input.focus();
  return isValid;
}

/**
 * Put an API error next to the field it concerns: `fields` maps API parameter names to
 * controls; `pick(error)` may name one for errors without a `param`. Otherwise the error
 * goes into `alert` (a form-level message). Returns the control that got it, if any.
 */
export function showApiError(error, { fields = {}, alert, pick } = {}) {
  const name = (error.param && error.param.split(".")[0]) || (pick ? pick(error) : null);
  const target = name ? fields[name] : null;
  if (target) {
    target.setError(error.message);
    target.input.focus();
    return target;
  }
  if (alert) {
    alert.textContent = error.message;
    alert.hidden = false;
    alert.focus();
  }
  return null;
}

/** A form-level error message box (hidden while empty). */
export function formAlert() {
  return h("div", { class: "alert alert-error", role: "alert", tabindex: "-1", hidden: true });
}

/** Parse an optional positive integer limit ("" means unlimited: null). */
export function parseLimit(control) {
  const text = control.value();
  if (text === "") return null;
  const number = Number(text);
  if (!Number.isInteger(number) || number < 1) {
    control.setError("Enter a whole number of at least 1, or leave empty for unlimited.");
    return undefined;
  }
  return number;
}
