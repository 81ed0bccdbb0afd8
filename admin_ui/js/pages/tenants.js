// Tenants: create, change weight and limits (in a dialog), delete with confirmation.

import { api } from "../api.js";
import { confirmDialog, openDialog } from "../components/dialog.js";
import { h } from "../components/dom.js";
import { checkFields, field, formAlert, NAME_HINT, parseLimit, showApiError } from "../components/field.js";
import { formatDate, formatLimit, formatNumber } from "../components/format.js";
import { card, loadInto, pageHead, rowButton } from "../components/page.js";
import { table } from "../components/table.js";
import { toast } from "../components/toast.js";

export const title = "Tenants";

const LIMIT_HINT = "Empty means unlimited.";

/** The weight and limit controls, filled from `tenant` when editing. */
function settingsFields(tenant = null) {
  const limit = (name, label) => field({
    label, name, type: "number", hint: LIMIT_HINT, value: tenant ? tenant[name] ?? "" : "",
    attrs: { min: "1", step: "1", inputmode: "numeric" },
  });
  return {
    weight: field({
      label: "Weight", name: "weight", type: "number", required: true, value: tenant ? tenant.weight : "1",
      hint: "The tenant's share of the engine under contention, relative to the others' (1 by default). "
        + "Applies from the engine's next step.",
      attrs: { min: "0", step: "any", inputmode: "decimal" },
    }),
    max_concurrent_requests: limit("max_concurrent_requests", "Max concurrent requests"),
    max_requests_per_minute: limit("max_requests_per_minute", "Max requests per minute"),
    max_tokens_per_minute: limit("max_tokens_per_minute", "Max tokens per minute"),
  };
}

/** The body for the API, or null (errors shown next to the fields) when a value is invalid. */
function settingsBody(fields) {
  if (!checkFields(Object.values(fields))) return null;
  const body = {};
  const weight = Number(fields.weight.value());
  if (!(weight > 0)) {
    fields.weight.setError("Enter a number above 0.");
    fields.weight.input.focus();
    return null;
  }
  body.weight = weight;
  for (const name of ["max_concurrent_requests", "max_requests_per_minute", "max_tokens_per_minute"]) {
    const value = parseLimit(fields[name]);
    if (value === undefined) {
      fields[name].input.focus();
      return null;
    }
    body[name] = value;
  }
  return body;
}

function createForm(onCreated) {
  const name = field({ label: "Name", name: "name", required: true, hint: NAME_HINT, attrs: { autocomplete: "off", spellcheck: "false" } });
  const settings = settingsFields();
  const fields = { name, ...settings };
  const alert = formAlert();
  const submit = h("button", { type: "submit", class: "button" }, "Create tenant");
  const form = h("form", { novalidate: true },
    alert, h("div", { class: "form-grid compact" }, Object.values(fields).map((f) => f.root)),
    h("div", { class: "form-actions" }, submit));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    alert.hidden = true;
    if (!checkFields([name], { names: [name] })) return;
    const body = settingsBody(settings);
    if (!body) return;
    submit.disabled = true;
    try {
      const tenant = await api.tenants.create({ name: name.value(), ...body });
      form.reset();
      toast(`Tenant ${tenant.name} created.`, "success");
      onCreated(tenant);
    } catch (error) {
      showApiError(error, { fields, alert });
    } finally {
      submit.disabled = false;
    }
  });
  return form;
}

function editTenant(tenant, onSaved) {
  const fields = settingsFields(tenant);
  const alert = formAlert();
  openDialog({
    title: `Edit tenant ${tenant.name}`,
    body: [alert, h("div", { class: "form-grid" }, Object.values(fields).map((f) => f.root))],
    actions: [
      { label: "Cancel", kind: "secondary" },
      {
        label: "Save changes", submit: true,
        onClick: async () => {
          alert.hidden = true;
          const body = settingsBody(fields);
          if (!body) return false;
          try {
            const saved = await api.tenants.update(tenant.name, body);
            toast(`Tenant ${saved.name} saved.`, "success");
            onSaved(saved);
            return true;
          } catch (error) {
            showApiError(error, { fields, alert });
            return false;
          }
        },
      },
    ],
  });
  fields.weight.input.focus();
}

function tenantTable(tenants, { onEdit, onDelete }) {
  return table({
    caption: `${tenants.length} tenant${tenants.length === 1 ? "" : "s"}`,
    rows: tenants,
    rowKey: (t) => t.name,
    empty: "No tenants yet.",
    columns: [
      { label: "Name", cell: (t) => h("strong", {}, t.name) },
      { label: "Weight", numeric: true, cell: (t) => formatNumber(t.weight) },
      { label: "Concurrent", numeric: true, cell: (t) => formatLimit(t.max_concurrent_requests) },
      { label: "Requests/min", numeric: true, cell: (t) => formatLimit(t.max_requests_per_minute) },
      { label: "Tokens/min", numeric: true, cell: (t) => formatLimit(t.max_tokens_per_minute) },
      { label: "In flight", numeric: true, cell: (t) => formatNumber(t.requests_in_flight) },
      { label: "Created", className: "nowrap", cell: (t) => formatDate(t.created_at) },
      {
        label: "Actions", hideLabel: true, className: "actions",
        cell: (t) => [
          rowButton("Edit", `Edit tenant ${t.name}`, () => onEdit(t)),
          rowButton("Delete", `Delete tenant ${t.name}`, () => onDelete(t), "link-danger"),
        ],
      },
    ],
  });
}

export function render(container) {
  const listTarget = h("div", {});
  const refresh = () => loadInto(listTarget, api.tenants.list, (tenants) => tenantTable(tenants, { onEdit, onDelete }));
  const onEdit = (tenant) => editTenant(tenant, refresh);

  async function onDelete(tenant) {
    const isConfirmed = await confirmDialog({
      title: `Delete tenant ${tenant.name}?`,
      message: "Its API keys stop working at once, and its adapters, system prompts and usage records are deleted. This cannot be undone.",
      confirmLabel: "Delete tenant",
    });
    if (!isConfirmed) return;
    try {
      await api.tenants.remove(tenant.name);
      toast(`Tenant ${tenant.name} deleted.`, "success");
    } catch (error) {
      toast(`Could not delete ${tenant.name}: ${error.message}`, "error");
    }
    refresh();
  }

  container.append(
    pageHead("Tenants", "Each tenant has its own API keys, adapters and limits, and a weight for fair sharing."),
    h("p", { class: "muted", id: "weights-note" }, "Limits refuse requests past them (429). Weights share the "
      + "engine under contention: a tenant of weight 2 gets twice the service (prompt tokens + 2 x generated "
      + "tokens) of a tenant of weight 1 while both wait; a change applies from the engine's next step. "
      + "The Engine page shows each tenant's share."),
    card("Create a tenant", createForm(() => refresh())),
    h("section", { class: "card", "aria-labelledby": "tenants-list-title" },
      h("div", { class: "card-head" }, h("h2", { id: "tenants-list-title" }, "All tenants"),
        h("button", { type: "button", class: "button button-secondary", onclick: () => refresh() }, "Refresh")),
      listTarget));
  refresh();
}
