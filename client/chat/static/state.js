// The chat page's shared state, the current conversation's tree walks, and `actions`: the
// handlers the views call (filled in by app.js, so views import no module that imports them).

export const CONV_STORAGE = "triton-llm.conversation";

export const state = {
  config: null,
  model: null,        // the served (base) model's id
  convs: [],
  current: null,      // GET /api/conversations/{id}: {conversation, messages, root_ids, path}
  byId: new Map(),
  stream: null,       // the reply being generated (one at a time)
  editing: null,      // id of the user message being edited
  preparing: null,    // id of the conversation whose context the server is computing
  emptyEl: null,
};

/** {openConversation, reloadCurrent, regenerate, submitEdit, stop}: set by app.js. */
export const actions = {};

export function siblingsOf(m) {
  return m.parent_id ? state.byId.get(m.parent_id).children : state.current.root_ids;
}

export function pathTo(id) {
  const out = [];
  for (let m = state.byId.get(id); m; m = m.parent_id ? state.byId.get(m.parent_id) : null) out.unshift(m);
  return out;
}

export const busy = () => Boolean(state.stream || state.preparing);
