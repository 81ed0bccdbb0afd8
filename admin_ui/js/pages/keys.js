// API keys: create (the secret is shown once, with a copy button), list, revoke.

import { api } from "../api.js";
import { confirmDialog, openDialog } from "../components/dialog.js";
import { h } from "../components/dom.js";
import { field, formAlert, showApiError } from "../components/field.js";
import { formatDate } from "../components/format.js";
import { card, loadInto, pageHead, rowButton } from "../components/page.js";
import { table } from "../components/table.js";
import { toast } from "../components/toast.js";

export const title = "API keys";

export const LAST_USED_NOTE = "Last used is recorded at most once a minute per key, so it can be up to a minute behind.";

async function copyText(input) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(input.value);
    return;
  }
  // Plain-http hosts other than localhost have no Clipboard API.
  input.select();
  if (!document.execCommand("copy")) throw new Error("copy refused");
}

function showSecret(created) {
  const secretId = "new-key-secret";
  const input = h("input", { id: secretId, type: "text", readonly: true, class: "mono", spellcheck: "false", autocomplete: "off" });
  input.value = created.secret;
  const status = h("span", { class: "muted", role: "status" });
  const copy = h("button", {
    type: "button", class: "button button-secondary",
    onclick: async () => {
      try {
        await copyText(input);
        status.textContent = "Copied to the clipboard.";
      } catch {
        input.select();
        status.textContent = "Could not copy: the key is selected, press Ctrl+C.";
      }
    },
  }, "Copy");
  const owner = created.key.tenant ? `tenant ${created.key.tenant}` : "admin";
  openDialog({
    title: "New API key",
    body: [
      h("div", { class: "alert alert-warning" }, "This is the only time the key is shown. Copy it now and keep it somewhere safe."),
      h("div", { class: "field" },
        h("label", { for: secretId }, `Key #${created.key.id} (${owner})`),
        h("div", { class: "secret-row" }, input, copy),
        status),
    ],
    actions: [{ label: "Done", kind: null }],
  });
  input.focus();
  input.select();
}

function createForm(tenantNames, onCreated) {
  const role = field({
    label: "Kind of key", name: "role", type: "select", required: true,
    options: [{ value: "tenant", label: "Tenant key (calls /v1)" }, { value: "admin", label: "Admin key (this UI and /admin/api)" }],
  });
  const tenant = field({ label: "Tenant", name: "tenant", type: "select", required: true, options: tenantNames });
  const alert = formAlert();
  const submit = h("button", { type: "submit", class: "button" }, "Create key");
  role.input.addEventListener("change", () => {
    tenant.input.disabled = role.value() === "admin";
    tenant.input.required = role.value() !== "admin";
  });
  const form = h("form", { novalidate: true }, alert,
    h("div", { class: "form-grid" }, role.root, tenant.root),
    h("div", { class: "form-actions" }, submit));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    alert.hidden = true;
    tenant.clearError();
    const isAdmin = role.value() === "admin";
    if (!isAdmin && !tenant.value()) {
      tenant.setError("Choose a tenant (create one on the Tenants page first).");
      tenant.input.focus();
      return;
    }
    submit.disabled = true;
    try {
      const created = await api.keys.create(isAdmin ? { admin: true } : { tenant: tenant.value() });
      onCreated(created);
      showSecret(created);
    } catch (error) {
      showApiError(error, { fields: { tenant }, alert });
    } finally {
      submit.disabled = false;
    }
  });
  return { form, tenant };
}

function keyTable(keys, onRevoke) {
  return table({
    caption: `${keys.length} key${keys.length === 1 ? "" : "s"}`,
    rows: keys,
    rowKey: (k) => String(k.id),
    empty: "No keys match.",
    columns: [
      { label: "ID", numeric: true, cell: (k) => `#${k.id}` },
      { label: "Prefix", cell: (k) => h("code", {}, `${k.prefix}…`) },
      { label: "Role", cell: (k) => h("span", { class: k.role === "admin" ? "badge badge-info" : "badge badge-off" }, k.role) },
      { label: "Tenant", cell: (k) => k.tenant ?? "—" },
      { label: "Created", className: "nowrap", cell: (k) => formatDate(k.created_at) },
      { label: "Last used", className: "nowrap", cell: (k) => (k.last_used_at ? formatDate(k.last_used_at) : "never") },
      {
        label: "Status", cell: (k) => (k.is_revoked
          ? h("span", { class: "badge badge-bad", title: `Revoked ${formatDate(k.revoked_at)}` }, "revoked")
          : h("span", { class: "badge badge-ok" }, "active")),
      },
      {
        label: "Actions", hideLabel: true, className: "actions",
        cell: (k) => (k.is_revoked ? null : rowButton("Revoke", `Revoke key #${k.id}`, () => onRevoke(k), "link-danger")),
      },
    ],
  });
}

export function render(container) {
  const listTarget = h("div", {});
  const filter = field({ label: "Tenant", name: "filter-tenant", type: "select", options: [{ value: "", label: "All keys" }] });
  const showRevoked = field({ label: "Show revoked keys", name: "show-revoked", type: "checkbox" });
  const create = createForm([], () => refresh());

  function refresh() {
    return loadInto(listTarget, () => api.keys.list(filter.value() || undefined),
      (keys) => keyTable(showRevoked.value() ? keys : keys.filter((k) => !k.is_revoked), revoke));
  }

  async function revoke(key) {
    const who = key.tenant ? `tenant ${key.tenant}` : "an admin";
    const isConfirmed = await confirmDialog({
      title: `Revoke key #${key.id}?`,
      message: `Requests made with this key (${who}, ${key.prefix}…) are refused from now on. This cannot be undone.`,
      confirmLabel: "Revoke key",
    });
    if (!isConfirmed) return;
    try {
      await api.keys.revoke(key.id);
      toast(`Key #${key.id} revoked.`, "success");
    } catch (error) {
      toast(`Could not revoke key #${key.id}: ${error.message}`, "error");
    }
    refresh();
  }

  filter.input.addEventListener("change", refresh);
  showRevoked.input.addEventListener("change", refresh);
  container.append(
    pageHead("API keys", "Tenant keys call the OpenAI API (/v1); admin keys call the admin API. Only a hash of each key is stored."),
    card("Create a key", create.form),
    h("section", { class: "card", "aria-labelledby": "keys-list-title" },
      h("div", { class: "card-head" }, h("h2", { id: "keys-list-title" }, "Keys"),
        h("div", { class: "toolbar" }, filter.root, showRevoked.root)),
      listTarget,
      h("p", { class: "muted note", id: "last-used-note" }, LAST_USED_NOTE)));

  api.tenants.list().then((tenants) => {
    const names = tenants.map((t) => ({ value: t.name, label: t.name }));
    create.tenant.setOptions(names);
    filter.setOptions([{ value: "", label: "All keys" }, ...names]);
  }).catch(() => {});
  refresh();
}
