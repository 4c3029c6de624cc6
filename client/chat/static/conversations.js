// Loading the page's data (config, models, conversations) and the sidebar's conversation list:
// open, create, delete.
import {api, convPath} from "./api.js";
import {$, el, fmt, guarded, hideError, scrollToBottom, setKeyStatus, showError} from "./dom.js";
import {loadModels} from "./models.js";
import {CONV_STORAGE, actions, state} from "./state.js";
import {render} from "./view.js";

export async function loadAll() {
  hideError();
  try {
    state.config = await api("GET", "/api/config");
    setKeyStatus(true);
    state.model = await loadModels(state.config.model);
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

export async function refreshList() {
  state.convs = (await api("GET", "/api/conversations")).data;
  renderList();
}

export async function openConversation(id) {
  state.editing = null;
  state.current = await api("GET", convPath(id));
  state.byId = new Map(state.current.messages.map((m) => [m.id, m]));
  localStorage.setItem(CONV_STORAGE, id);
  renderList();
  render();
  scrollToBottom();
}

export const reloadCurrent = () => state.current && openConversation(state.current.conversation.id);

export function renderList() {
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
    if (state.stream && state.stream.convId === id) actions.stop();
    await api("DELETE", convPath(id));
    const wasCurrent = state.current && state.current.conversation.id === id;
    await refreshList();
    if (wasCurrent) {
      if (state.convs.length) await openConversation(state.convs[0].id);
      else { state.current = null; localStorage.removeItem(CONV_STORAGE); render(); }
    }
  });
}

export async function newConversation() {
  const conv = await api("POST", "/api/conversations", {});
  await refreshList();
  await openConversation(conv.id);
  $("input").focus();
  return conv;
}
