// System prompts: add (optionally bound to one of the tenant's adapters), list with token
// counts, the KV the engine holds for each and the requests reading it now, view the full
// text, delete.

import { api } from "../api.js";
import { confirmDialog, openDialog } from "../components/dialog.js";
import { h } from "../components/dom.js";
import { checkFields, field, formAlert, NAME_HINT, showApiError } from "../components/field.js";
import { formatDate, formatNumber } from "../components/format.js";
import { card, loadInto, pageHead, rowButton } from "../components/page.js";
import { table } from "../components/table.js";
import { toast } from "../components/toast.js";

export const title = "System prompts";

const NO_ADAPTER = { value: "", label: "None" };
const PREVIEW_CHARS = 60;

function addForm(onAdded) {
  const tenant = field({ label: "Tenant", name: "tenant", type: "select", required: true });
  const name = field({ label: "Name", name: "name", required: true, hint: NAME_HINT, attrs: { autocomplete: "off", spellcheck: "false" } });
  const adapter = field({
    label: "Adapter", name: "adapter", type: "select", options: [NO_ADAPTER],
    hint: "Optional: bind the prompt to one of the tenant's adapters.",
  });
  const text = field({ label: "Text", name: "text", type: "textarea", required: true, wide: true, attrs: { rows: "6", maxlength: "200000" } });
  const fields = { tenant, name, adapter, text };
  const alert = formAlert();
  const submit = h("button", { type: "submit", class: "button" }, "Add prompt");

  // The latest tenant's adapters win: a slower answer for the tenant chosen before (the page
  // loads the first tenant's at once) must not replace them.
  let latest = 0;
  async function loadAdapters() {
    const chosen = tenant.value();
    if (!chosen) return;
    const ticket = ++latest;
    let options = [NO_ADAPTER];
    try {
      const adapters = await api.adapters.list(chosen);
      options = [NO_ADAPTER, ...adapters.map((a) => ({ value: a.name, label: a.name }))];
    } catch {
      // no adapters offered: the prompt can still be added unbound
    }
    if (ticket === latest) adapter.setOptions(options);
  }
  tenant.input.addEventListener("change", loadAdapters);

  const form = h("form", { novalidate: true }, alert,
    h("div", { class: "form-grid" }, tenant.root, name.root, adapter.root, text.root),
    h("div", { class: "form-actions" }, submit));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    alert.hidden = true;
    if (!checkFields(Object.values(fields), { names: [name] })) return;
    submit.disabled = true;
    try {
      const prompt = await api.prompts.create({
        tenant: tenant.value(), name: name.value(), text: text.input.value, adapter: adapter.value() || null,
      });
      name.input.value = "";
      text.input.value = "";
      toast(`System prompt ${prompt.tenant}/${prompt.name} added (${formatNumber(prompt.num_tokens)} tokens).`, "success");
      onAdded(prompt);
    } catch (error) {
      showApiError(error, { fields, alert });
    } finally {
      submit.disabled = false;
    }
  });
  return { form, tenant, loadAdapters };
}

function viewPrompt(prompt) {
  openDialog({
    title: `System prompt ${prompt.tenant}/${prompt.name}`,
    body: [
      h("dl", { class: "stats" },
        h("div", { class: "stat" }, h("dt", {}, "Tokens"), h("dd", {}, formatNumber(prompt.num_tokens))),
        h("div", { class: "stat" }, h("dt", {}, "Adapter"), h("dd", {}, prompt.adapter ?? "none"))),
      h("p", { class: "muted" }, `Added ${formatDate(prompt.created_at)}.`),
      h("pre", { class: "prompt-text", tabindex: "0", "aria-label": "Prompt text" }, prompt.text),
    ],
    actions: [{ label: "Close", kind: "secondary", autofocus: true }],
  });
}

function promptTable(prompts, { onView, onDelete }) {
  return table({
    caption: `${prompts.length} system prompt${prompts.length === 1 ? "" : "s"}`,
    rows: prompts,
    rowKey: (p) => `${p.tenant}/${p.name}`,
    empty: "No system prompts yet.",
    columns: [
      { label: "Tenant", cell: (p) => p.tenant },
      { label: "Name", className: "nowrap", cell: (p) => h("strong", {}, p.name) },
      { label: "Adapter", className: "nowrap", cell: (p) => p.adapter ?? h("span", { class: "muted" }, "none") },
      { label: "Tokens", numeric: true, cell: (p) => formatNumber(p.num_tokens) },
      {
        label: "KV cached", className: "nowrap",
        cell: (p) => (p.cached_blocks ? `${formatNumber(p.cached_blocks)} blocks` : h("span", { class: "muted" }, "not yet")),
      },
      { label: "In use", numeric: true, cell: (p) => formatNumber(p.num_requests_using) },
      { label: "Text", cell: (p) => (p.text.length > PREVIEW_CHARS ? `${p.text.slice(0, PREVIEW_CHARS)}…` : p.text) },
      { label: "Created", className: "nowrap", cell: (p) => formatDate(p.created_at) },
      {
        label: "Actions", hideLabel: true, className: "actions",
        cell: (p) => [
          rowButton("View", `View system prompt ${p.tenant}/${p.name}`, () => onView(p)),
          rowButton("Delete", `Delete system prompt ${p.tenant}/${p.name}`, () => onDelete(p), "link-danger"),
        ],
      },
    ],
  });
}

export function render(container) {
  const listTarget = h("div", {});
  const add = addForm(() => refresh());
  const refresh = () => loadInto(listTarget, () => api.prompts.list(), (prompts) => promptTable(prompts, { onView: viewPrompt, onDelete }));

  async function onDelete(prompt) {
    const isConfirmed = await confirmDialog({
      title: `Delete system prompt ${prompt.tenant}/${prompt.name}?`,
      message: "It is removed from the registry. This cannot be undone.",
      confirmLabel: "Delete prompt",
    });
    if (!isConfirmed) return;
    try {
      await api.prompts.remove(prompt.tenant, prompt.name);
      toast(`System prompt ${prompt.tenant}/${prompt.name} deleted.`, "success");
    } catch (error) {
      toast(`Could not delete ${prompt.tenant}/${prompt.name}: ${error.message}`, "error");
    }
    refresh();
  }

  container.append(
    pageHead("System prompts", "Named system prompts of each tenant, with their length in tokens of the base model's tokenizer."),
    h("p", { class: "alert alert-info", id: "prompts-note" }, "A request names a prompt with system_prompt (the openai client: "
      + "extra_body). The engine computes its KV when it is added and holds it while it is registered; "
      + "requests that name it read that KV instead of computing it."),
    card("Add a system prompt", add.form),
    h("section", { class: "card", "aria-labelledby": "prompts-list-title" },
      h("div", { class: "card-head" }, h("h2", { id: "prompts-list-title" }, "All system prompts"),
        h("button", { type: "button", class: "button button-secondary", onclick: () => refresh() }, "Refresh")),
      listTarget));

  api.tenants.list().then((tenants) => {
    add.tenant.setOptions(tenants.map((t) => ({ value: t.name, label: t.name })));
    add.loadAdapters();
  }).catch(() => {});
  refresh();
}
