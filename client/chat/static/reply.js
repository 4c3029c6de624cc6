// Asking for a reply: send a message, edit one (a new branch) or regenerate, stream the answer
// from the model picked in the sidebar (models.js) and store it with its stats; stop a stream.
import {api, convPath} from "./api.js";
import {$, autosize, guarded, scrollToBottom, showError} from "./dom.js";
import {newConversation, refreshList, reloadCurrent, renderList} from "./conversations.js";
import {currentModel} from "./models.js";
import {state} from "./state.js";
import {liveStats, newReply, streamReply} from "./stream.js";
import {paintStream, render} from "./view.js";

async function generate(userId, ctx) {
  if (state.stream) return;
  const convId = state.current.conversation.id;
  const note = {policy: ctx.policy, applied: ctx.applied, dropped_turns: ctx.dropped_turns,
                summarized_turns: ctx.summarized_turns, kept_turns: ctx.kept_turns,
                prompt_tokens: ctx.prompt_tokens, max_tokens: ctx.max_tokens,
                max_model_len: ctx.max_model_len, at: Date.now() / 1000};
  const model = currentModel();
  const s = newReply({convId, parentId: userId, note});
  state.stream = s;
  renderList();
  render();
  scrollToBottom();
  let error = null;
  try {
    await streamReply(s, {model, messages: ctx.messages, stream: true,
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
      finish_reason: s.stopped ? "abort" : (error ? "error" : s.finish), stats: {...liveStats(s), model},
      context: note});
    if (error) showError(error);
  } catch (e) {
    showError(e);
  }
  renderList();
  if (state.current && state.current.conversation.id === convId) await guarded(reloadCurrent);
  else render();
}

export function stop() {
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

export async function send() {
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

export function regenerate(userId) {
  guarded(async () => {
    const id = state.current.conversation.id;
    const ctx = await preparing(id, () => api("GET", convPath(id, `/context?leaf_id=${encodeURIComponent(userId)}`)));
    await generate(userId, ctx);
  });
}

/** Save an edited user message as a new branch and answer it. */
export function submitEdit(m, content) {
  return guarded(async () => {
    if (!content) return;
    const id = state.current.conversation.id;
    const res = await preparing(id, () => api("POST", convPath(id, `/messages/${m.id}/edit`), {content}));
    state.editing = null;
    await reloadCurrent();
    await generate(res.message.id, res.context);
  });
}
