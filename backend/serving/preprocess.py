"""The plain-Python half of the ``preprocessing`` model: prompt or chat messages -> token ids.

Chat messages go through the checkpoint's own chat template with the generation prompt appended,
exactly as ``AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True)`` does, so the
server and offline code see the same ids. A bad prompt is rejected here with an ``invalid_request``
EngineError naming it, before the engine sees the request; the prompt is checked against the
engine's own context window (backend/context.py). The request's other parameters pass through
unread: the engine's intake reads them once (intake.py); the readers both share are here
(``parse_parameters``, ``read``, ``fit_prompt``). Preprocessing reads only the
prompt's own: ``tools`` (shown to the model) and ``embed`` (an embedding fills the whole window).
``one_string`` / ``int_array`` read the prompt tensor and build the ``input_ids`` one.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from backend import protocol as P
from backend.context import context_window_for
from backend.errors import invalid_request
from backend.structured.tool_prompt import KEPT_FIELDS, template_inputs, tools_from_params
from common import param_codec as codec

ROLES = ("system", "developer", "user", "assistant", "tool")


CHARS_PER_TOKEN_CAP = 16       # prompt characters accepted per context-window token


def load_tokenizer(model_dir: str | pathlib.Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def parse_messages(raw: str) -> list[dict]:
    """OpenAI chat messages (JSON) -> [{"role", "content"}] with text content."""
    if not raw or not raw.strip():
        raise invalid_request(P.MESSAGES, "messages is empty")
    try:
        messages = json.loads(raw)
    except ValueError as exc:
        raise invalid_request(P.MESSAGES, f"messages is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise invalid_request(P.MESSAGES, "messages must be a non-empty JSON list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid_request(P.MESSAGES, f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise invalid_request(P.MESSAGES, f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        msg = {"role": role, "content": _content_text(m.get("content"), i, role)}
        for k in KEPT_FIELDS:               # tool calls and results (backend/structured/tool_prompt.py)
            if m.get(k) is not None:
                msg[k] = m[k]
        out.append(msg)
    return out


def _content_text(content, i: int, role: str) -> str:
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid_request(P.MESSAGES, f"messages[{i}].content[{j}] must be a text part "
                                                  '{"type": "text", "text": ...}')
            parts.append(part["text"])
        return "".join(parts)
    raise invalid_request(P.MESSAGES, f"messages[{i}].content must be a string or a list of text parts")


def parse_parameters(raw: str | dict | None) -> dict:
    """``request.parameters()`` (a JSON string) -> dict."""
    try:
        return codec.parse_raw(raw)
    except codec.ParamError as exc:
        raise invalid_request(exc.param, str(exc)) from None


def read(params: dict, name: str, default: Any = None) -> Any:
    """One parameter by its type, ``default`` when absent (preprocessing's ``embed``,
    postprocessing's ``skip_special_tokens``); EngineError if bad."""
    if params.get(name) is None:
        return default
    try:
        return codec.read(name, params[name])
    except codec.ParamError as exc:
        raise invalid_request(exc.param, str(exc)) from None


def fit_prompt(prompt_len: int, context_window: int, param: str, embedding: bool = False) -> int:
    """The room a prompt leaves to generate; rejects one that is empty or leaves none (an
    embedding may fill the whole window). Preprocessing checks its prompt with this too."""
    if prompt_len < 1:
        raise invalid_request(param, "the prompt is empty")
    if embedding:                           # the whole window, nothing generated
        if prompt_len > context_window:
            raise invalid_request(param, f"the input has {prompt_len} tokens but the context window is "
                                         f"{context_window} tokens")
        return 0
    if prompt_len >= context_window:
        raise invalid_request(param, f"the prompt has {prompt_len} tokens but the context window is "
                                     f"{context_window} tokens (at least one must be left to generate)")
    return context_window - prompt_len


class Preprocessor:
    def __init__(self, model_dir: str | pathlib.Path, context_window: int | None = None) -> None:
        """``context_window``: the engine's (generate_repository() writes it into the config);
        None computes it for the default engine options."""
        self.tokenizer = load_tokenizer(model_dir)
        self.context_window = context_window or context_window_for(model_dir)

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        extra: dict = {}
        if tools or any(len(m) > 2 for m in messages):     # tools or tool fields: backend/structured
            messages, extra = template_inputs(self.tokenizer, messages, tools)
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, **extra)
        except Exception as exc:           # the template's own raise_exception (e.g. role order)
            raise invalid_request(P.MESSAGES, f"the chat template rejected the messages: {exc}") from None
        return [int(t) for t in ids]

    def encode_prompt(self, text: str) -> list[int]:
        # The Rust tokenizer directly: the same ids as ``self.tokenizer.encode(text)`` (pinned by
        # tests/unit/test_serving_preprocess_encode.py) without transformers' Python wrapper, ~30 %
        # of a prompt's encode time on the way to the first token.
        rust = getattr(self.tokenizer, "backend_tokenizer", None)      # fast tokenizers only
        if rust is not None:
            return rust.encode(text).ids
        return [int(t) for t in self.tokenizer.encode(text)]

    def __call__(self, text_input: str | None, messages: str | None, params: dict) -> list[int]:
        """Token ids for one request's prompt; raises EngineError."""
        if (text_input is None) == (messages is None):
            raise invalid_request(P.TEXT_INPUT, "give exactly one of text_input (a prompt) or messages (chat JSON)")
        # Bounded before any work: a token is rarely longer than a few characters, so text past
        # CHARS_PER_TOKEN_CAP characters per context-window token can never fit; reject it
        # before JSON parsing and tokenization spend time and memory on it.
        limit = self.context_window * CHARS_PER_TOKEN_CAP
        given = text_input if messages is None else messages
        if len(given) > limit:
            raise invalid_request(P.TEXT_INPUT if messages is None else P.MESSAGES,
                                  f"the prompt has {len(given)} characters; at most {limit} "
                                  f"({CHARS_PER_TOKEN_CAP} per token of the {self.context_window}-token "
                                  "context window) are accepted")
        if messages is not None:
            tools = tools_from_params(params) if params.get("tools") not in (None, "", []) else None
            ids, param = self.encode_messages(parse_messages(messages), tools), P.MESSAGES
        else:
            if not text_input:
                raise invalid_request(P.TEXT_INPUT, "the prompt is empty")
            ids, param = self.encode_prompt(text_input), P.TEXT_INPUT
        fit_prompt(len(ids), self.context_window, param, embedding=read(params, P.EMBED, False))
        return ids


def one_string(array: np.ndarray | None, name: str) -> str | None:
    """A BYTES[1] input as text (None when the optional input is absent)."""
    if array is None:
        return None
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise invalid_request(name, f"{name} must hold exactly one string, got shape {list(np.shape(array))}")
    v = flat[0]
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid_request(name, f"{name} is not valid UTF-8") from None
    return str(v)


def int_array(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)
