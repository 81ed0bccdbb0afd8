// Modal dialogs on the native <dialog> element: focus is trapped inside, Escape closes it,
// and focus returns to what had it before.

import { h, uid } from "./dom.js";

/**
 * openDialog({title, body, actions, onClose, className})
 * body: a node or array of nodes. actions: [{label, kind, onClick, autofocus, submit}]. The
 * dialog's content is a form: Enter submits it through the action marked `submit`. An action
 * whose onClick returns (or resolves to) false keeps the dialog open. Returns {dialog, close}.
 */
export function openDialog({ title, body, actions = [], onClose, className }) {
  const titleId = uid("dialog-title");
  const opener = document.activeElement;
  let isBusy = false;

  async function run(action, event) {
    if (isBusy) return;
    isBusy = true;
    try {
      const keep = action.onClick ? await action.onClick(event) : undefined;
      if (keep !== false) close();
    } finally {
      isBusy = false;
    }
  }

  const buttons = actions.map((action) => h("button", {
    type: action.submit ? "submit" : "button",
    class: `button ${action.kind ? `button-${action.kind}` : ""}`.trim(),
    autofocus: action.autofocus || false,
    onclick: action.submit ? null : (event) => run(action, event),
  }, action.label));
  const submitAction = actions.find((action) => action.submit);
  const form = h("form", {
    novalidate: true,
    onsubmit: (event) => {
      event.preventDefault();
      if (submitAction) run(submitAction, event);
    },
  }, h("div", { class: "dialog-body" }, h("h2", { id: titleId }, title), body),
  buttons.length ? h("div", { class: "dialog-actions" }, buttons) : null);
  const dialog = h("dialog", { "aria-labelledby": titleId, class: className || null }, form);
  let isClosed = false;

  function close(result) {
    if (isClosed) return;
    isClosed = true;
    if (dialog.open) dialog.close();
    dialog.remove();
    if (opener && opener.isConnected && typeof opener.focus === "function") opener.focus();
    if (onClose) onClose(result);
  }

  dialog.addEventListener("close", () => close());
  document.body.append(dialog);
  dialog.showModal();
  return { dialog, close };
}

/** Ask before a destructive action. Resolves true when confirmed. */
export function confirmDialog({ title, message, confirmLabel = "Confirm", danger = true }) {
  return new Promise((resolve) => {
    let answer = false;
    openDialog({
      title,
      body: Array.isArray(message) ? message : h("p", {}, message),
      className: "confirm-dialog",
      actions: [
        { label: "Cancel", kind: "secondary", autofocus: true },
        { label: confirmLabel, kind: danger ? "danger" : null, onClick: () => { answer = true; } },
      ],
      onClose: () => resolve(answer),
    });
  });
}
