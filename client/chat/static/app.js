// triton-llm chat page: conversations and branches come from /api (client/chat/router.py);
// replies stream from the shim's POST /v1/chat/completions (stream.js).
import {api, apiKey, convPath, headers, setApiKey, setUnauthorizedHandler} from "./api.js";
import {liveStats, newReply, streamReply} from "./stream.js";

const $ = (id) => document.getElementById(id);
const CONV_STORAGE = "triton-llm.conversation";

const state = {
  config: null,
  model: null,
  convs: [],
  current: null,      // GET /api/conversations/{id}: {conversation, messages, root_ids, path}
  byId: new Map(),
  stream: null,       // the reply being generated (one at a time)
  editing: null,      // id of the user message being edited
};

// ------------------------------------------------------------------------------------- UI bits
function el(tag, attrs = {}, ...children) {
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

function showError(err) {
  const box = $("error");
  box.textContent = err instanceof Error ? err.message : String(err);
  box.hidden = false;
}
function hideError() { $("error").hidden = true; }

function setKeyStatus(ok, msg) {
  const s = $("key-status");
  s.textContent = ok ? "" : (msg || "API key rejected");
  s.classList.toggle("bad", !ok);
}

function nearBottom() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}
function scrollToBottom() { const box = $("messages"); box.scrollTop = box.scrollHeight; }

const fmt = (x, digits = 0) => (x === null || x === undefined || Number.isNaN(x)) ? "–" :
  Number(x).toLocaleString(undefined, {maximumFractionDigits: digits, minimumFractionDigits: digits});

// ------------------------------------------------------------------------------ loading state
async function loadAll() {
  hideError();
  try {
    state.config = await api("GET", "/api/config");
    setKeyStatus(true);
    state.model = state.config.model || await firstModel();
    $("model-info").textContent =
      `model ${state.model || "?"} · context ${fmt(state.config.max_model_len)} tokens`;
    await refreshList();
    const saved = localStorage.getItem(CONV_STORAGE);
    const pick = state.convs.find((c) => c.id === saved) || state.convs[0];
    if (pick) await openConversation(pick.id); else { state.current = null; render(); }
  } catch (e) {
    state.convs = []; state.current = null; renderList(); render();
    showError(e);
  }
}

async function firstModel() {
  try {
    const res = await fetch("/v1/models", {headers: headers(false)});
    const body = await res.json();
    return body.data && body.data.length ? body.data[0].id : null;
  } catch (_) { return null; }
}

async function refreshList() {
  state.convs = (await api("GET", "/api/conversations")).data;
  renderList();
}

async function openConversation(id) {
  state.editing = null;
  state.current = await api("GET", convPath(id));
  state.byId = new Map(state.current.messages.map((m) => [m.id, m]));
  localStorage.setItem(CONV_STORAGE, id);
  renderList();
  render();
  scrollToBottom();
}

const reloadCurrent = () => state.current && openConversation(state.current.conversation.id);

// ------------------------------------------------------------------------------------- sidebar
function renderList() {
  const ul = $("conversations");
  ul.replaceChildren(...state.convs.map((c) => {
    const active = state.current && state.current.conversation.id === c.id;
    const del = el("button", {class: "delete", title: "Delete conversation", text: "✕",
                              "data-testid": "delete-conv"});
    del.addEventListener("click", (ev) => { ev.stopPropagation(); confirmDelete(del, c.id); });
    return el("li", {class: active ? "active" : "", dataset: {id: c.id}, "data-testid": "conv-item",
                     title: c.title, onclick: () => guarded(() => openConversation(c.id))},
              el("span", {class: "conv-title", text: c.title}),
              state.stream && state.stream.convId === c.id ? el("span", {class: "conv-busy", text: "●"}) : null,
              del);
  }));
  $("no-conversations").hidden = state.convs.length > 0;
}

function confirmDelete(button, id) {
  if (!button.classList.contains("confirm")) {     // first click arms, second click deletes
    button.classList.add("confirm");
    button.textContent = "Delete?";
    setTimeout(() => { button.classList.remove("confirm"); button.textContent = "✕"; }, 3000);
    return;
  }
  guarded(async () => {
    if (state.stream && state.stream.convId === id) stop();
    await api("DELETE", convPath(id));
    const wasCurrent = state.current && state.current.conversation.id === id;
    await refreshList();
    if (wasCurrent) {
      if (state.convs.length) await openConversation(state.convs[0].id);
      else { state.current = null; localStorage.removeItem(CONV_STORAGE); render(); }
    }
  });
}

async function newConversation() {
  const conv = await api("POST", "/api/conversations", {});
  await refreshList();
  await openConversation(conv.id);
  $("input").focus();
  return conv;
}

async function guarded(fn) {
  hideError();
  try { await fn(); } catch (e) { showError(e); }
}

// ------------------------------------------------------------------------------- conversation
function siblingsOf(m) {
  return m.parent_id ? state.byId.get(m.parent_id).children : state.current.root_ids;
}

function pathTo(id) {
  const out = [];
  for (let m = state.byId.get(id); m; m = m.parent_id ? state.byId.get(m.parent_id) : null) out.unshift(m);
  return out;
}

function render() {
  const conv = state.current && state.current.conversation;
  $("conv-title").textContent = conv ? conv.title : "No conversation";
  $("rename").disabled = $("settings-toggle").disabled = !conv;
  if (!conv) $("settings").hidden = true;
  const box = $("messages");
  const stick = nearBottom();
  const streaming = state.stream && conv && state.stream.convId === conv.id ? state.stream : null;
  const path = streaming ? pathTo(streaming.parentId)
    : (conv ? state.current.path.map((id) => state.byId.get(id)) : []);
  const nodes = path.map((m, i) => messageEl(m, i === path.length - 1));
  if (streaming) nodes.push(streamingEl(streaming));
  if (state.preparing && conv && state.preparing === conv.id)
    nodes.push(el("div", {class: "msg preparing", "data-testid": "preparing"},
                  el("span", {class: "stats", text: "Preparing the context…"})));
  if (!nodes.length) nodes.push(state.emptyEl);
  box.replaceChildren(...nodes);
  const busy = Boolean(state.stream || state.preparing);
  $("send").hidden = Boolean(streaming);
  $("send").disabled = busy;
  $("stop").hidden = !streaming;
  if (stick) scrollToBottom();
}

function branchNav(m) {
  const sibs = siblingsOf(m);
  if (sibs.length < 2) return null;
  const i = sibs.indexOf(m.id);
  const go = (j) => guarded(async () => {
    await api("PUT", convPath(state.current.conversation.id, "/leaf"), {message_id: sibs[j]});
    await reloadCurrent();
  });
  const busy = Boolean(state.stream || state.preparing);
  return el("span", {class: "branch", "data-testid": "branch"},
            el("button", {title: "Previous branch", text: "‹", disabled: busy || i === 0,
                          "data-testid": "branch-prev", onclick: () => go(i - 1)}),
            el("span", {"data-testid": "branch-pos", text: `${i + 1}/${sibs.length}`}),
            el("button", {title: "Next branch", text: "›", disabled: busy || i === sibs.length - 1,
                          "data-testid": "branch-next", onclick: () => go(i + 1)}));
}

function messageEl(m, isLast) {
  const busy = Boolean(state.stream || state.preparing);
  const meta = el("div", {class: "meta"},
                  el("span", {class: "role", text: m.role === "user" ? "You" : "Assistant"}),
                  branchNav(m),
                  el("span", {text: new Date(m.created_at * 1000).toLocaleTimeString()}));
  const node = el("div", {class: `msg ${m.role}`, dataset: {id: m.id, role: m.role},
                          "data-testid": `msg-${m.role}`}, meta);
  const notice = m.role === "assistant" && m.context ? noticeEl(m.context) : null;
  if (notice) node.append(notice);
  if (state.editing === m.id) { node.append(editBox(m)); return node; }
  node.append(el("div", {class: "bubble", "data-testid": "content", text: m.content}));
  const actions = el("span", {class: "actions"});
  if (m.role === "user") {
    actions.append(el("button", {class: "link", text: "Edit", disabled: busy, "data-testid": "edit",
                                 onclick: () => { state.editing = m.id; render(); }}));
    if (isLast) actions.append(el("button", {class: "link", text: "Generate reply", disabled: busy,
                                             "data-testid": "generate", onclick: () => regenerate(m.id)}));
  } else {
    actions.append(el("button", {class: "link", text: "Regenerate", disabled: busy,
                                 "data-testid": "regenerate", onclick: () => regenerate(m.parent_id)}));
  }
  node.append(el("div", {class: "footer"}, m.role === "assistant" ? statsEl(m) : null, actions));
  return node;
}

function noticeEl(ctx) {
  if (!ctx.applied) return null;
  const when = ctx.at ? ` at ${new Date(ctx.at * 1000).toLocaleTimeString()}` : "";
  const turns = (n, what) => `${n} ${what}${n === 1 ? "" : "s"}`;
  const kept = `the last ${turns(ctx.kept_turns, "turn")} kept`;
  const text = ctx.summarized_turns
    ? `Context: ${turns(ctx.summarized_turns, "older turn")} summarized by the model ` +
      `(summarize policy, ${kept})${when}`
    : `Context: ${turns(ctx.dropped_turns, "older turn")} left out (truncate policy, ${kept})${when}`;
  return el("div", {class: "notice", "data-testid": "context-notice", text});
}

function statsEl(m) {
  const s = m.stats || {};
  const parts = [];
  if (m.stopped) parts.push(el("span", {class: "tag stopped", "data-testid": "stopped", text: "stopped"}));
  else if (m.finish_reason && m.finish_reason !== "stop")
    parts.push(el("span", {class: "tag", text: m.finish_reason}));
  const approx = s.approx_tokens ? "~" : "";
  const text = [
    `${approx}${fmt(s.completion_tokens)} tokens`,
    s.prompt_tokens != null ? `${fmt(s.cached_tokens)}/${fmt(s.prompt_tokens)} prompt cached` : null,
    `TTFT ${fmt(s.ttft_ms)} ms`,
    `${fmt(s.tokens_per_s, 1)} tok/s`,
  ].filter(Boolean).join(" · ");
  const title = serverTitle(s);
  return el("span", {class: "stats", "data-testid": "stats", title}, ...parts, text);
}

function serverTitle(s) {
  const lines = ["Measured in the browser: TTFT from sending the request, tok/s while streaming."];
  const srv = s.server || {};
  if (srv.ttft != null) {
    const decode = srv.e2e != null && s.completion_tokens > 1 && srv.e2e > srv.ttft
      ? `, ${fmt((s.completion_tokens - 1) / (srv.e2e - srv.ttft), 1)} tok/s` : "";
    lines.push(`Server: TTFT ${fmt(srv.ttft * 1000, 1)} ms${decode}, queue ${fmt((srv.queue_time || 0) * 1000, 1)} ms` +
               `, preemptions ${srv.num_preemptions ?? 0}`);
  }
  if (srv.request_id) lines.push(`Request ${srv.request_id}`);
  return lines.join("\n");
}

function editBox(m) {
  const area = el("textarea", {"data-testid": "edit-input"});
  area.value = m.content;
  setTimeout(() => area.focus(), 0);
  const submit = () => guarded(async () => {
    const content = area.value.trim();
    if (!content) return;
    const id = state.current.conversation.id;
    const res = await preparing(id, () => api("POST", convPath(id, `/messages/${m.id}/edit`), {content}));
    state.editing = null;
    await reloadCurrent();
    await generate(res.message.id, res.context);
  });
  area.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); submit(); }
    if (ev.key === "Escape") { state.editing = null; render(); }
  });
  return el("div", {class: "edit-box"}, area,
            el("div", {class: "row-end"},
               el("span", {class: "small muted", text: "Saving makes a new branch; the original stays."}),
               el("button", {class: "ghost", text: "Cancel", onclick: () => { state.editing = null; render(); }}),
               el("button", {class: "primary", text: "Save & submit", "data-testid": "edit-save",
                             onclick: submit})));
}

// ---------------------------------------------------------------------------------- streaming
function streamingEl(s) {
  if (!s.el) {
    s.bubble = el("div", {class: "bubble", "data-testid": "content"});
    s.statsLine = el("span", {class: "stats", text: "waiting for the first token…"});
    s.el = el("div", {class: "msg assistant streaming", "data-testid": "msg-streaming"},
              el("div", {class: "meta"}, el("span", {class: "role", text: "Assistant"})),
              noticeEl({...s.note}), s.bubble, el("div", {class: "footer"}, s.statsLine));
  }
  s.bubble.textContent = s.content;
  return s.el;
}

function paintStream(s) {
  if (s.painted) return;
  s.painted = true;
  requestAnimationFrame(() => {
    s.painted = false;
    if (!s.bubble) return;
    const stick = nearBottom();
    s.bubble.textContent = s.content;
    const st = liveStats(s);
    s.statsLine.textContent = `${fmt(st.completion_tokens)} tokens · TTFT ${fmt(st.ttft_ms)} ms · ` +
      `${fmt(st.tokens_per_s, 1)} tok/s`;
    if (stick) scrollToBottom();
  });
}

async function generate(userId, ctx) {
  if (state.stream) return;
  const convId = state.current.conversation.id;
  const note = {policy: ctx.policy, applied: ctx.applied, dropped_turns: ctx.dropped_turns,
                summarized_turns: ctx.summarized_turns, kept_turns: ctx.kept_turns,
                prompt_tokens: ctx.prompt_tokens, max_tokens: ctx.max_tokens,
                max_model_len: ctx.max_model_len, at: Date.now() / 1000};
  const s = newReply({convId, parentId: userId, note});
  state.stream = s;
  renderList();
  render();
  scrollToBottom();
  let error = null;
  try {
    await streamReply(s, {model: state.model, messages: ctx.messages, stream: true,
                          stream_options: {include_usage: true}, max_tokens: ctx.max_tokens,
                          ...(ctx.params || {})}, paintStream);
  } catch (e) {
    if (e.name === "AbortError" || s.stopped) s.stopped = true; else error = e;
  }
  state.stream = null;
  try {
    if (error && !s.content) throw error;
    await api("POST", convPath(convId, "/messages"), {
      role: "assistant", parent_id: userId, content: s.content, stopped: s.stopped,
      finish_reason: s.stopped ? "abort" : (error ? "error" : s.finish), stats: liveStats(s), context: note});
    if (error) showError(error);
  } catch (e) {
    showError(e);
  }
  renderList();
  if (state.current && state.current.conversation.id === convId) await guarded(reloadCurrent);
  else render();
}

function stop() {
  if (!state.stream) return;
  state.stream.stopped = true;
  state.stream.controller.abort();
}

// The server computes the context (the summarize policy may call the model first): say so.
async function preparing(convId, fn) {
  state.preparing = convId;
  render();
  try { return await fn(); } finally { state.preparing = null; render(); }
}

async function send() {
  const text = $("input").value.trim();
  if (!text || state.stream || state.preparing) return;
  await guarded(async () => {
    if (!state.current) await newConversation();
    const conv = state.current.conversation;
    const path = state.current.path;
    const last = path.length ? state.byId.get(path[path.length - 1]) : null;
    // After an assistant reply: continue. After an unanswered message: replace it (a sibling).
    const parent = last ? (last.role === "assistant" ? last.id : last.parent_id) : null;
    const res = await preparing(conv.id, () =>
      api("POST", convPath(conv.id, "/messages"), {role: "user", content: text, parent_id: parent}));
    $("input").value = "";
    autosize();
    await refreshList();          // the first message names the conversation
    await reloadCurrent();
    await generate(res.message.id, res.context);
  });
}

function regenerate(userId) {
  guarded(async () => {
    const id = state.current.conversation.id;
    const ctx = await preparing(id, () => api("GET", convPath(id, `/context?leaf_id=${encodeURIComponent(userId)}`)));
    await generate(userId, ctx);
  });
}

// ------------------------------------------------------------------------ title and settings
function startRename() {
  if (!state.current) return;
  const input = $("title-input");
  input.value = state.current.conversation.title;
  input.hidden = false;
  $("conv-title").hidden = true;
  input.focus();
  input.select();
}

function endRename(save) {
  const input = $("title-input");
  if (input.hidden) return;
  input.hidden = true;
  $("conv-title").hidden = false;
  const title = input.value.trim();
  if (!save || !title || title === state.current.conversation.title) return;
  guarded(async () => {
    await api("PATCH", convPath(state.current.conversation.id), {title});
    await refreshList();
    await reloadCurrent();
  });
}

function openSettings() {
  const form = $("settings");
  if (!form.hidden) { form.hidden = true; return; }
  const c = state.current.conversation;
  $("set-system").value = c.system_prompt;
  $("set-policy").value = c.policy;
  $("set-keep").value = c.keep_turns;
  $("set-max-tokens").value = c.max_tokens ?? "";
  $("set-temperature").value = c.params.temperature ?? "";
  $("set-ignore-eos").checked = Boolean(c.params.ignore_eos);
  $("settings-status").textContent = "";
  form.hidden = false;
}

async function saveSettings(ev) {
  ev.preventDefault();
  const c = state.current.conversation;
  const params = {...c.params};
  const temp = $("set-temperature").value;
  if (temp === "") delete params.temperature; else params.temperature = Number(temp);
  if ($("set-ignore-eos").checked) params.ignore_eos = true; else delete params.ignore_eos;
  const maxTokens = $("set-max-tokens").value;
  await guarded(async () => {
    await api("PATCH", convPath(c.id), {
      system_prompt: $("set-system").value, policy: $("set-policy").value,
      keep_turns: Number($("set-keep").value), max_tokens: maxTokens === "" ? null : Number(maxTokens), params});
    await reloadCurrent();
    $("settings-status").textContent = "Saved.";
  });
}

function autosize() {
  const area = $("input");
  area.style.height = "auto";
  area.style.height = Math.min(area.scrollHeight + 2, 220) + "px";
}

// ------------------------------------------------------------------------------------- wiring
function init() {
  state.emptyEl = $("empty");
  setUnauthorizedHandler((msg) => setKeyStatus(false, msg));
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", (ev) => {
    const key = ev.target.value.trim();
    setApiKey(key);
    loadAll();
  });
  $("new-chat").addEventListener("click", () => guarded(newConversation));
  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
  });
  $("input").addEventListener("input", autosize);
  $("stop").addEventListener("click", stop);
  $("rename").addEventListener("click", startRename);
  $("conv-title").addEventListener("dblclick", startRename);
  $("title-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") endRename(true);
    if (ev.key === "Escape") endRename(false);
  });
  $("title-input").addEventListener("blur", () => endRename(true));
  $("settings-toggle").addEventListener("click", openSettings);
  $("settings-cancel").addEventListener("click", () => { $("settings").hidden = true; });
  $("settings").addEventListener("submit", saveSettings);
  loadAll();
}

init();
