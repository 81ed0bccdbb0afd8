// Adapters: the list of every tenant's PEFT LoRA adapters, upload (with a progress bar and the
// server's validation errors in words, next to the file they concern), delete with confirmation.

import { api } from "../api.js";
import { confirmDialog } from "../components/dialog.js";
import { h, replace } from "../components/dom.js";
import { checkFields, field, formAlert, NAME_HINT, showApiError } from "../components/field.js";
import { formatBytes, formatDay, formatNumber, shortHash } from "../components/format.js";
import { card, loadInto, pageHead, rowButton } from "../components/page.js";
import { table } from "../components/table.js";
import { toast } from "../components/toast.js";

export const title = "Adapters";

/** What an adapter's digest is (the admin API's description of it, in short). */
export const IDENTITY = "the adapter's identity, the sha256 of its tensors and their scaling: "
  + "the same in the CLI (loraplex adapter list) and on the Engine page. Uploads of the same "
  + "tensors share it, and one copy in the engine.";

/** Which file an upload error without `param` concerns. */
function fileOfError(error) {
  if (error.status === 413) return "adapter_model";
  if (error.code !== "invalid_adapter") return null;
  return /safetensors|tensor|adapter_model|dtype|shape|layer/i.test(error.message) ? "adapter_model" : "adapter_config";
}

function uploadForm(onUploaded) {
  const tenant = field({ label: "Tenant", name: "tenant", type: "select", required: true });
  const name = field({
    label: "Adapter name", name: "name", required: true, hint: `Requests name it as their model. ${NAME_HINT}`,
    attrs: { autocomplete: "off", spellcheck: "false" },
  });
  const config = field({
    label: "adapter_config.json", name: "adapter_config", type: "file", required: true,
    hint: "The PEFT config (LoRA, DoRA, IA3) or a FLoRA config.", attrs: { accept: ".json,application/json" },
  });
  const weights = field({
    label: "adapter_model.safetensors", name: "adapter_model", type: "file", required: true,
    hint: "The LoRA weights (safetensors only).", attrs: { accept: ".safetensors" },
  });
  const alert = formAlert();
  const bar = h("progress", { max: "100", value: "0", "aria-label": "Upload progress" });
  const barText = h("span", { "aria-live": "polite" });
  const progress = h("div", { class: "upload-progress", hidden: true }, bar, barText);
  const submit = h("button", { type: "submit", class: "button" }, "Upload adapter");
  const fields = { tenant, name, adapter_config: config, adapter_model: weights };

  function setProgress({ loaded, total, phase }) {
    const percent = total ? Math.round((100 * loaded) / total) : 0;
    bar.value = percent;
    bar.dataset.phase = phase;
    barText.textContent = phase === "validating" ? "Validating…" : `Uploading… ${percent}%`;
  }

  const form = h("form", { novalidate: true, class: "upload-form" },
    alert,
    h("div", { class: "form-grid" }, tenant.root, name.root, config.root, weights.root),
    progress,
    h("div", { class: "form-actions" }, submit));

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    alert.hidden = true;
    if (!checkFields(Object.values(fields), { names: [name] })) return;
    const body = new FormData();
    body.append("tenant", tenant.value());
    body.append("name", name.value());
    body.append("adapter_config", config.value(), "adapter_config.json");
    body.append("adapter_model", weights.value(), "adapter_model.safetensors");
    submit.disabled = true;
    progress.hidden = false;
    setProgress({ loaded: 0, total: 1, phase: "uploading" });
    try {
      const adapter = await api.adapters.upload(body, setProgress).promise;
      bar.value = 100;
      barText.textContent = "Uploaded";
      const chosenTenant = tenant.input.value;
      form.reset();
      tenant.input.value = chosenTenant;  // the next upload is most likely for the same tenant
      const kind = FAMILY_LABELS[adapter.family] || adapter.family;
      const size = adapter.family === "ia3" ? kind : `${kind} rank ${adapter.rank}`;
      toast(`Adapter ${adapter.tenant}/${adapter.name} uploaded (${size}).`, "success");
      onUploaded(adapter);
    } catch (error) {
      progress.hidden = true;
      showApiError(error, { fields, alert, pick: fileOfError });
    } finally {
      submit.disabled = false;
    }
  });
  return { form, tenant };
}

const FAMILY_LABELS = { lora: "LoRA", dora: "DoRA", ia3: "IA3", flora: "FLoRA" };
const FAMILY_TITLES = {
  lora: "W0 + s·B·A (PEFT LoRA)",
  dora: "LoRA with a learned magnitude per output row (PEFT use_dora)",
  ia3: "learned vectors scaling k, v and the feed-forward input (PEFT IA3)",
  flora: "W0 ⊙ (B·A), element-wise (FLoRA)",
};

function adapterTable(adapters, onDelete) {
  return table({
    caption: `${adapters.length} adapter${adapters.length === 1 ? "" : "s"}`,
    rows: adapters,
    rowKey: (a) => `${a.tenant}/${a.name}`,
    empty: "No adapters yet. Upload one above.",
    columns: [
      { label: "Tenant", cell: (a) => a.tenant },
      { label: "Name", className: "nowrap", cell: (a) => h("strong", {}, a.name) },
      { label: "Family", className: "nowrap", cell: (a) => h("span", { class: "tag", title: FAMILY_TITLES[a.family] || "" }, FAMILY_LABELS[a.family] || a.family) },
      { label: "Rank", numeric: true, cell: (a) => (a.family === "ia3" ? "–" : String(a.rank)) },
      {
        label: "Targets",
        cell: (a) => h("span", { class: "tags", title: a.target_modules.join(", ") },
          a.target_modules.map((m) => h("span", { class: "tag" }, m.replace(/_proj$/, "")))),
      },
      { label: "Size", numeric: true, className: "nowrap", cell: (a) => formatBytes(a.size_bytes) },
      { label: "Digest", cell: (a) => h("code", { title: `${a.digest}: ${IDENTITY}` }, shortHash(a.digest)) },
      { label: "Created", className: "nowrap", cell: (a) => formatDay(a.created_at) },
      { label: "Requests", numeric: true, cell: (a) => formatNumber(a.num_requests_served) },
      {
        label: "On device", cell: (a) => (a.is_resident
          ? h("span", { class: "badge badge-ok" }, "resident")
          : h("span", { class: "badge badge-off" }, a.is_loaded ? "in host memory" : "not loaded")),
      },
      {
        label: "Actions", hideLabel: true, className: "actions",
        cell: (a) => rowButton("Delete", `Delete adapter ${a.tenant}/${a.name}`, () => onDelete(a), "link-danger"),
      },
    ],
  });
}

export function render(container) {
  const listTarget = h("div", {});
  const filter = field({ label: "Tenant", name: "filter-tenant", type: "select", options: [{ value: "", label: "All tenants" }] });
  const upload = uploadForm(() => refresh());

  function refresh() {
    return loadInto(listTarget, () => api.adapters.list(filter.value() || undefined), (adapters) => adapterTable(adapters, remove));
  }

  async function remove(adapter) {
    const isConfirmed = await confirmDialog({
      title: `Delete adapter ${adapter.tenant}/${adapter.name}?`,
      message: "Requests naming it are refused from now on; requests running with it finish. "
        + "System prompts bound to it are deleted too. This cannot be undone.",
      confirmLabel: "Delete adapter",
    });
    if (!isConfirmed) return;
    try {
      await api.adapters.remove(adapter.tenant, adapter.name);
      toast(`Adapter ${adapter.tenant}/${adapter.name} deleted.`, "success");
    } catch (error) {
      toast(`Could not delete ${adapter.tenant}/${adapter.name}: ${error.message}`, "error");
    }
    refresh();
  }

  filter.input.addEventListener("change", refresh);
  container.append(
    pageHead("Adapters", "PEFT LoRA adapters of every tenant. A request picks one by naming it as its model."),
    card("Upload an adapter",
      h("p", { class: "muted" }, "Choose the two files of a PEFT LoRA adapter. The server checks them against the served base model and stores nothing unless every check passes."),
      upload.form),
    h("section", { class: "card", "aria-labelledby": "adapters-list-title" },
      h("div", { class: "card-head" },
        h("h2", { id: "adapters-list-title" }, "All adapters"),
        h("div", { class: "toolbar" }, filter.root,
          h("button", { type: "button", class: "button button-secondary", onclick: () => refresh() }, "Refresh"))),
      listTarget,
      h("p", { class: "muted note", id: "digest-note" }, `Digest: ${IDENTITY} On device: in one of the engine's adapter slots (on the GPU, or in memory when the engine runs on the CPU).`)));

  api.tenants.list().then((tenants) => {
    const names = tenants.map((t) => ({ value: t.name, label: t.name }));
    upload.tenant.setOptions(names);
    filter.setOptions([{ value: "", label: "All tenants" }, ...names]);
  }).catch((error) => {
    if (error.status !== 401) replace(listTarget, h("div", { class: "alert alert-error", role: "alert" }, error.message));
  });
  refresh();
}
