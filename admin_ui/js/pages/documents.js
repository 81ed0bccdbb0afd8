// Documents: add (typed, or read from a UTF-8 text file), list with token counts, view the
// full text, delete. Requests include them by name (documents); the engine computes each one's
// KV once and reuses it wherever it lands in a prompt (CacheBlend).

import { api } from "../api.js";
import { confirmDialog, openDialog } from "../components/dialog.js";
import { h } from "../components/dom.js";
import { checkFields, field, formAlert, NAME_HINT, showApiError } from "../components/field.js";
import { formatDate, formatNumber } from "../components/format.js";
import { card, loadInto, pageHead, rowButton } from "../components/page.js";
import { table } from "../components/table.js";
import { toast } from "../components/toast.js";

export const title = "Documents";

const MAX_CHARS = 200000;
const PREVIEW_CHARS = 60;

// A file's text, or an error naming what is wrong with it (binary, too large).
async function readTextFile(file) {
  if (file.size > 4 * MAX_CHARS) throw new Error(`${file.name} is larger than ${4 * MAX_CHARS} bytes`);
  const bytes = new Uint8Array(await file.arrayBuffer());
  try {
    const text = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
    if (text.includes("\u0000")) throw new Error("NUL");
    return text;
  } catch {
    throw new Error(`${file.name} is not UTF-8 text (a binary file?)`);
  }
}

function addForm(onAdded) {
  const tenant = field({ label: "Tenant", name: "tenant", type: "select", required: true });
  const name = field({ label: "Name", name: "name", required: true, hint: NAME_HINT, attrs: { autocomplete: "off", spellcheck: "false" } });
  const file = field({
    label: "File", name: "file", type: "file", hint: "Optional: fill the text from a UTF-8 text file.",
    attrs: { accept: ".txt,.md,text/plain,text/markdown" },
  });
  const text = field({ label: "Text", name: "text", type: "textarea", required: true, wide: true, attrs: { rows: "8", maxlength: String(MAX_CHARS) } });
  const fields = { tenant, name, text };
  const alert = formAlert();
  const submit = h("button", { type: "submit", class: "button" }, "Add document");

  file.input.addEventListener("change", async () => {
    const chosen = file.input.files[0];
    if (!chosen) return;
    try {
      text.input.value = await readTextFile(chosen);
      if (!name.input.value) name.input.value = chosen.name.replace(/\.[^.]*$/, "").replace(/[^A-Za-z0-9._-]/g, "-").slice(0, 64);
    } catch (error) {
      file.input.value = "";
      file.setError(error.message);
    }
  });

  const form = h("form", { novalidate: true }, alert,
    h("div", { class: "form-grid" }, tenant.root, name.root, file.root, text.root),
    h("div", { class: "form-actions" }, submit));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    alert.hidden = true;
    if (!checkFields(Object.values(fields), { names: [name] })) return;
    submit.disabled = true;
    try {
      const doc = await api.documents.create({ tenant: tenant.value(), name: name.value(), text: text.input.value });
      name.input.value = "";
      text.input.value = "";
      file.input.value = "";
      toast(`Document ${doc.tenant}/${doc.name} added (${formatNumber(doc.num_tokens)} tokens).`, "success");
      onAdded(doc);
    } catch (error) {
      showApiError(error, { fields, alert });
    } finally {
      submit.disabled = false;
    }
  });
  return { form, tenant };
}

function viewDocument(doc) {
  openDialog({
    title: `Document ${doc.tenant}/${doc.name}`,
    body: [
      h("dl", { class: "stats" },
        h("div", { class: "stat" }, h("dt", {}, "Tokens"), h("dd", {}, formatNumber(doc.num_tokens))),
        h("div", { class: "stat" }, h("dt", {}, "Characters"), h("dd", {}, formatNumber(doc.num_chars)))),
      h("p", { class: "muted" }, `Added ${formatDate(doc.created_at)}.`),
      h("pre", { class: "prompt-text", tabindex: "0", "aria-label": "Document text" }, doc.text),
    ],
    actions: [{ label: "Close", kind: "secondary", autofocus: true }],
  });
}

function documentTable(docs, { onView, onDelete }) {
  return table({
    caption: `${docs.length} document${docs.length === 1 ? "" : "s"}`,
    rows: docs,
    rowKey: (d) => `${d.tenant}/${d.name}`,
    empty: "No documents yet.",
    columns: [
      { label: "Tenant", cell: (d) => d.tenant },
      { label: "Name", className: "nowrap", cell: (d) => h("strong", {}, d.name) },
      { label: "Tokens", numeric: true, cell: (d) => formatNumber(d.num_tokens) },
      { label: "Text", cell: (d) => (d.text.length > PREVIEW_CHARS ? `${d.text.slice(0, PREVIEW_CHARS)}…` : d.text) },
      { label: "Created", className: "nowrap", cell: (d) => formatDate(d.created_at) },
      {
        label: "Actions", hideLabel: true, className: "actions",
        cell: (d) => [
          rowButton("View", `View document ${d.tenant}/${d.name}`, () => onView(d)),
          rowButton("Delete", `Delete document ${d.tenant}/${d.name}`, () => onDelete(d), "link-danger"),
        ],
      },
    ],
  });
}

export function render(container) {
  const listTarget = h("div", {});
  const add = addForm(() => refresh());
  const refresh = () => loadInto(listTarget, () => api.documents.list(), (docs) => documentTable(docs, { onView: viewDocument, onDelete }));

  async function onDelete(doc) {
    const isConfirmed = await confirmDialog({
      title: `Delete document ${doc.tenant}/${doc.name}?`,
      message: "It is removed from the registry; requests that name it are refused. This cannot be undone.",
      confirmLabel: "Delete document",
    });
    if (!isConfirmed) return;
    try {
      await api.documents.remove(doc.tenant, doc.name);
      toast(`Document ${doc.tenant}/${doc.name} deleted.`, "success");
    } catch (error) {
      toast(`Could not delete ${doc.tenant}/${doc.name}: ${error.message}`, "error");
    }
    refresh();
  }

  container.append(
    pageHead("Documents", "Named documents of each tenant (a knowledge base), with their length in tokens of the base model's tokenizer."),
    h("p", { class: "alert alert-info", id: "documents-note" }, "A request names documents with documents (the openai client: "
      + "extra_body), in the order it wants them. The engine computes each document's KV once and reuses it wherever "
      + "the document lands, computing again a share of its tokens (documents_recompute_share, default 0.2); "
      + "documents_blend: false computes them in full."),
    card("Add a document", add.form),
    h("section", { class: "card", "aria-labelledby": "documents-list-title" },
      h("div", { class: "card-head" }, h("h2", { id: "documents-list-title" }, "All documents"),
        h("button", { type: "button", class: "button button-secondary", onclick: () => refresh() }, "Refresh")),
      listTarget));

  api.tenants.list().then((tenants) => {
    add.tenant.setOptions(tenants.map((t) => ({ value: t.name, label: t.name })));
  }).catch(() => {});
  refresh();
}
