// triton-llm chat page: conversations and branches come from /api (client/chat/router.py);
// replies stream from the shim's POST /v1/chat/completions (stream.js). This module wires the
// page's controls to the modules that do the work:
//   dom.js            element building, errors, scrolling, formatting
//   state.js          shared state, tree walks, the actions views call
//   models.js         the model / LoRA adapter picker (GET /v1/models)
//   conversations.js  loading, the sidebar list, open / new / delete
//   view.js           the current conversation and the streaming reply
//   reply.js          send, edit, regenerate, stream and store a reply, stop
//   settings.js       rename and the settings form
import {apiKey, setApiKey, setUnauthorizedHandler} from "./api.js";
import {$, autosize, guarded, setKeyStatus} from "./dom.js";
import {loadAll, newConversation, openConversation, reloadCurrent} from "./conversations.js";
import {initModelPicker} from "./models.js";
import {regenerate, send, stop, submitEdit} from "./reply.js";
import {endRename, openSettings, saveSettings, startRename} from "./settings.js";
import {actions, state} from "./state.js";

function init() {
  Object.assign(actions, {openConversation, reloadCurrent, regenerate, submitEdit, stop});
  state.emptyEl = $("empty");
  setUnauthorizedHandler((msg) => setKeyStatus(false, msg));
  initModelPicker();
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", (ev) => {
    setApiKey(ev.target.value.trim());
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
