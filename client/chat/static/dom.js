// DOM helpers of the chat page: element building, the error box, the API-key status, scrolling,
// number formatting, and `guarded` (runs an action, showing its error instead of throwing).

export const $ = (id) => document.getElementById(id);

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined && c !== false) node.append(c);
  return node;
}

export function showError(err) {
  const box = $("error");
  box.textContent = err instanceof Error ? err.message : String(err);
  box.hidden = false;
}
export function hideError() { $("error").hidden = true; }

export async function guarded(fn) {
  hideError();
  try { await fn(); } catch (e) { showError(e); }
}

export function setKeyStatus(ok, msg) {
  const s = $("key-status");
  s.textContent = ok ? "" : (msg || "API key rejected");
  s.classList.toggle("bad", !ok);
}

export function nearBottom() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}
export function scrollToBottom() { const box = $("messages"); box.scrollTop = box.scrollHeight; }

/** The composer grows with its text, up to a limit. */
export function autosize() {
  const area = $("input");
  area.style.height = "auto";
  area.style.height = Math.min(area.scrollHeight + 2, 220) + "px";
}

export const fmt = (x, digits = 0) => (x === null || x === undefined || Number.isNaN(x)) ? "–" :
  Number(x).toLocaleString(undefined, {maximumFractionDigits: digits, minimumFractionDigits: digits});
