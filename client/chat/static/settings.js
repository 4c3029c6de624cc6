// The conversation's title (rename in place) and its settings form (system prompt, context
// policy, reply options).
import {api, convPath} from "./api.js";
import {$, guarded} from "./dom.js";
import {refreshList, reloadCurrent} from "./conversations.js";
import {state} from "./state.js";

export function startRename() {
  if (!state.current) return;
  const input = $("title-input");
  input.value = state.current.conversation.title;
  input.hidden = false;
  $("conv-title").hidden = true;
  input.focus();
  input.select();
}

export function endRename(save) {
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

export function openSettings() {
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

export async function saveSettings(ev) {
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
