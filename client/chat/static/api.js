// HTTP helpers for the chat page: the API key (localStorage), JSON calls, OpenAI-shaped errors.

export const KEY_STORAGE = "triton-llm.api-key";

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

let onUnauthorized = () => {};
/** Called with the server's message whenever a call answers 401 (the key is missing or wrong). */
export function setUnauthorizedHandler(fn) { onUnauthorized = fn; }

export function apiKey() { return localStorage.getItem(KEY_STORAGE) || ""; }

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
}

export function headers(json = true) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

/** The message of an error response: OpenAI's {error: {message}}, FastAPI's {detail}, or text. */
export async function errorMessage(res) {
  const text = await res.text();
  try {
    const body = JSON.parse(text);
    const e = body.error || (body.detail && body.detail.error) || body.detail;
    if (typeof e === "string") return e;
    if (e && e.message) return e.message;
  } catch (_) { /* not JSON */ }
  return text || `${res.status} ${res.statusText}`;
}

export async function api(method, path, body) {
  const res = await fetch(path, {
    method, headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!res.ok) {
    const msg = await errorMessage(res);
    if (res.status === 401) onUnauthorized(msg);
    throw new ApiError(res.status, msg);
  }
  return res.status === 204 ? null : res.json();
}

export const convPath = (id, rest = "") => `/api/conversations/${encodeURIComponent(id)}${rest}`;
