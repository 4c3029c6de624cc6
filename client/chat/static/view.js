// The current conversation's view: its path of messages with branch switches, edit boxes, context
// notices and reply stats, and the reply streaming into it.
import {api, convPath} from "./api.js";
import {$, el, fmt, guarded, nearBottom, scrollToBottom} from "./dom.js";
import {actions, busy, pathTo, siblingsOf, state} from "./state.js";
import {liveStats} from "./stream.js";

export function render() {
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
  $("send").hidden = Boolean(streaming);
  $("send").disabled = busy();
  $("stop").hidden = !streaming;
  if (stick) scrollToBottom();
}

function branchNav(m) {
  const sibs = siblingsOf(m);
  if (sibs.length < 2) return null;
  const i = sibs.indexOf(m.id);
  const go = (j) => guarded(async () => {
    await api("PUT", convPath(state.current.conversation.id, "/leaf"), {message_id: sibs[j]});
    await actions.reloadCurrent();
  });
  return el("span", {class: "branch", "data-testid": "branch"},
            el("button", {title: "Previous branch", text: "‹", disabled: busy() || i === 0,
                          "data-testid": "branch-prev", onclick: () => go(i - 1)}),
            el("span", {"data-testid": "branch-pos", text: `${i + 1}/${sibs.length}`}),
            el("button", {title: "Next branch", text: "›", disabled: busy() || i === sibs.length - 1,
                          "data-testid": "branch-next", onclick: () => go(i + 1)}));
}

function messageEl(m, isLast) {
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
  const actionsEl = el("span", {class: "actions"});
  if (m.role === "user") {
    actionsEl.append(el("button", {class: "link", text: "Edit", disabled: busy(), "data-testid": "edit",
                                   onclick: () => { state.editing = m.id; render(); }}));
    if (isLast) actionsEl.append(el("button", {class: "link", text: "Generate reply", disabled: busy(),
                                               "data-testid": "generate", onclick: () => actions.regenerate(m.id)}));
  } else {
    actionsEl.append(el("button", {class: "link", text: "Regenerate", disabled: busy(),
                                   "data-testid": "regenerate", onclick: () => actions.regenerate(m.parent_id)}));
  }
  node.append(el("div", {class: "footer"}, m.role === "assistant" ? statsEl(m) : null, actionsEl));
  return node;
}

export function noticeEl(ctx) {
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
  if (s.model && s.model !== state.model)          // answered by a LoRA adapter (models.js)
    parts.push(el("span", {class: "tag", "data-testid": "reply-model", text: s.model}));
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
  return el("span", {class: "stats", "data-testid": "stats", title: serverTitle(s)}, ...parts, text);
}

function serverTitle(s) {
  const lines = ["Measured in the browser: TTFT from sending the request, tok/s while streaming."];
  if (s.model) lines.push(`Model ${s.model}`);
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
  const submit = () => actions.submitEdit(m, area.value.trim());
  const cancel = () => { state.editing = null; render(); };
  area.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); submit(); }
    if (ev.key === "Escape") cancel();
  });
  return el("div", {class: "edit-box"}, area,
            el("div", {class: "row-end"},
               el("span", {class: "small muted", text: "Saving makes a new branch; the original stays."}),
               el("button", {class: "ghost", text: "Cancel", onclick: cancel}),
               el("button", {class: "primary", text: "Save & submit", "data-testid": "edit-save",
                             onclick: submit})));
}

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

/** Repaint a streaming reply at most once per frame. */
export function paintStream(s) {
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
