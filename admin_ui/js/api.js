// The admin REST API client (/admin/api). The admin key lives in sessionStorage (this tab only)
// and goes out as `Authorization: Bearer <key>`; there are no cookies, so no CSRF exposure.

const KEY_STORAGE = "loraplex.adminKey";
const API_ROOT = new URL("api/", document.baseURI);
export const UNAUTHORIZED_EVENT = "loraplex:unauthorized";

export function getKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function setKey(key) {
  sessionStorage.setItem(KEY_STORAGE, key);
}

export function clearKey() {
  sessionStorage.removeItem(KEY_STORAGE);
}

/** A failed call: `status` (0 when the server could not be reached), and the OpenAI-style
 * error body's `message`, `code` and `param`. */
export class ApiError extends Error {
  constructor(status, message, code = null, param = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
    this.param = param;
  }

  static fromBody(status, text) {
    let error = null;
    try {
      error = JSON.parse(text).error;
    } catch {
      // not JSON: a proxy's page, say
    }
    if (error && typeof error.message === "string") {
      return new ApiError(status, error.message, error.code ?? null, error.param ?? null);
    }
    return new ApiError(status, `The server answered ${status}${text ? `: ${text.slice(0, 200)}` : ""}`);
  }
}

function url(path, query) {
  const target = new URL(path.replace(/^\//, ""), API_ROOT);
  for (const [name, value] of Object.entries(query || {})) {
    if (value !== null && value !== undefined && value !== "") target.searchParams.set(name, value);
  }
  return target;
}

function signalUnauthorized(error, { key }) {
  // A key that stops working mid-session (revoked, say) ends the session; a sign-in attempt
  // (an explicit key) reports its own error instead.
  if (error.status === 401 && key === undefined) {
    window.dispatchEvent(new CustomEvent(UNAUTHORIZED_EVENT, { detail: error }));
  }
}

/** One JSON call. `key` overrides the stored key (used to check a key before signing in). */
export async function request(method, path, { body, query, key } = {}) {
  const headers = { Accept: "application/json" };
  const secret = key ?? getKey();
  if (secret) headers.Authorization = `Bearer ${secret}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(url(path, query), {
      method, headers, body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store", credentials: "omit",
    });
  } catch {
    throw new ApiError(0, "Could not reach the server. Check that loraplex is running.");
  }
  const text = await response.text();
  if (!response.ok) {
    const error = ApiError.fromBody(response.status, text);
    signalUnauthorized(error, { key });
    throw error;
  }
  return text ? JSON.parse(text) : null;
}

/**
 * POST a multipart form with XMLHttpRequest (fetch reports no upload progress).
 * onProgress({loaded, total, phase}) with phase "uploading" while bytes go out, then
 * "validating" once they are all sent and the server is checking the adapter.
 * Returns {promise, abort}.
 */
export function upload(path, form, onProgress = () => {}) {
  const xhr = new XMLHttpRequest();
  const promise = new Promise((resolve, reject) => {
    xhr.open("POST", url(path));
    const secret = getKey();
    if (secret) xhr.setRequestHeader("Authorization", `Bearer ${secret}`);
    xhr.setRequestHeader("Accept", "application/json");
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onProgress({ loaded: event.loaded, total: event.total, phase: "uploading" });
    });
    xhr.upload.addEventListener("load", () => onProgress({ loaded: 1, total: 1, phase: "validating" }));
    xhr.addEventListener("load", () => {
      if (xhr.status >= 200 && xhr.status < 300) {
        resolve(xhr.responseText ? JSON.parse(xhr.responseText) : null);
        return;
      }
      const error = ApiError.fromBody(xhr.status, xhr.responseText);
      signalUnauthorized(error, {});
      reject(error);
    });
    xhr.addEventListener("error", () => reject(new ApiError(0, "The upload failed: the connection to the server was lost.")));
    xhr.addEventListener("abort", () => reject(new ApiError(0, "The upload was cancelled.", "aborted")));
    xhr.send(form);
  });
  return { promise, abort: () => xhr.abort() };
}

const enc = encodeURIComponent;

export const api = {
  me: (key) => request("GET", "me", { key }),
  tenants: {
    list: () => request("GET", "tenants"),
    create: (body) => request("POST", "tenants", { body }),
    update: (name, body) => request("PATCH", `tenants/${enc(name)}`, { body }),
    remove: (name) => request("DELETE", `tenants/${enc(name)}`),
  },
  keys: {
    list: (tenant) => request("GET", "keys", { query: { tenant } }),
    create: (body) => request("POST", "keys", { body }),
    revoke: (id) => request("POST", `keys/${enc(id)}/revoke`),
  },
  adapters: {
    list: (tenant) => request("GET", "adapters", { query: { tenant } }),
    upload: (form, onProgress) => upload("adapters", form, onProgress),
    remove: (tenant, name) => request("DELETE", `adapters/${enc(tenant)}/${enc(name)}`),
  },
  prompts: {
    list: (tenant) => request("GET", "prompts", { query: { tenant } }),
    create: (body) => request("POST", "prompts", { body }),
    remove: (tenant, name) => request("DELETE", `prompts/${enc(tenant)}/${enc(name)}`),
  },
  documents: {
    list: (tenant) => request("GET", "documents", { query: { tenant } }),
    create: (body) => request("POST", "documents", { body }),
    remove: (tenant, name) => request("DELETE", `documents/${enc(tenant)}/${enc(name)}`),
  },
  usage: (query) => request("GET", "usage", { query }),
  engine: () => request("GET", "engine"),
};
