// The model picker: the served model and its LoRA adapters, as GET /v1/models lists them (an
// adapter has a `parent`). The choice is each reply's `model` field, which the shim routes to the
// adapter; it is remembered in localStorage and falls back to the base model when it is gone.
import {headers} from "./api.js";
import {$, el} from "./dom.js";

const MODEL_STORAGE = "triton-llm.model";
let models = [];      // [{id, parent}]
let base = null;

/** Fill the picker; returns the base model's id (`served`, from /api/config, if given). */
export async function loadModels(served) {
  models = [];
  try {
    const res = await fetch("/v1/models", {headers: headers(false)});
    if (res.ok) models = ((await res.json()).data || []).map((m) => ({id: m.id, parent: m.parent || null}));
  } catch (_) { /* the picker offers the served model alone */ }
  base = served || (models.find((m) => !m.parent) || models[0] || {}).id || null;
  if (base && !models.some((m) => m.id === base)) models.unshift({id: base, parent: null});
  render();
  return base;
}

/** The model the next reply asks for. */
export function currentModel() { return $("model-select").value || base; }

function render() {
  const sel = $("model-select");
  sel.replaceChildren(...models.map((m) => el("option", {
    value: m.id, text: m.parent ? `${m.id} (adapter of ${m.parent})` : m.id})));
  const saved = localStorage.getItem(MODEL_STORAGE);
  sel.value = models.some((m) => m.id === saved) ? saved : (base || "");
  sel.disabled = models.length < 2;
}

export function initModelPicker() {
  $("model-select").addEventListener("change", (ev) => {
    if (ev.target.value === base) localStorage.removeItem(MODEL_STORAGE);
    else localStorage.setItem(MODEL_STORAGE, ev.target.value);
  });
}
