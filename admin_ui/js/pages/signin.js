// Sign in with an admin key. The key is checked (GET /admin/api/me) before it is kept.

import { api, setKey } from "../api.js";
import { h } from "../components/dom.js";
import { field, formAlert } from "../components/field.js";

export const title = "Sign in";

/** render(container, {onSignedIn(me), notice}) */
export function render(container, { onSignedIn, notice } = {}) {
  const keyField = field({
    label: "Admin API key", name: "key", type: "password", required: true,
    hint: ["Find it in ", h("code", {}, "<data-dir>/admin-api-key"), " or create one with ", h("code", {}, "loraplex key create --admin"), ". It is kept in this browser tab only."],
    attrs: { autocomplete: "off", spellcheck: "false", autocapitalize: "off" },
  });
  const alert = formAlert();
  const submit = h("button", { type: "submit", class: "button" }, "Sign in");
  const form = h("form", { novalidate: true, "aria-labelledby": "signin-title" },
    alert, keyField.root, h("div", { class: "form-actions" }, submit));

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = keyField.value();
    keyField.clearError();
    alert.hidden = true;
    if (!key) {
      keyField.setError("Enter an admin API key.");
      keyField.input.focus();
      return;
    }
    submit.disabled = true;
    try {
      const me = await api.me(key);
      setKey(key);
      onSignedIn(me);
    } catch (error) {
      let message = error.message;
      if (error.status === 401) message = "This key was not accepted: it is unknown or revoked.";
      else if (error.status === 403) message = "This is a tenant's key. The admin UI takes an admin key.";
      if (error.status === 401 || error.status === 403) {
        keyField.setError(message);
        keyField.input.focus();
      } else {
        alert.textContent = message;
        alert.hidden = false;
      }
    } finally {
      submit.disabled = false;
    }
  });

  container.append(h("div", { class: "signin card" },
    h("h1", { id: "signin-title", tabindex: "-1" }, "Sign in to loraplex"),
    h("p", { class: "muted" }, "Manage tenants, API keys, adapters, system prompts, usage and the engine."),
    notice ? h("div", { class: "alert alert-info", role: "status" }, notice) : null,
    form));
  keyField.input.focus();
}
