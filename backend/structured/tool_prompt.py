"""Tools and tool messages into the chat template (preprocessing).

A template that knows about tools (it mentions ``tools``, as Qwen2.5's and Hermes' do) gets them
as the ``tools=`` argument of ``apply_chat_template`` and the messages as OpenAI sent them
(assistant ``tool_calls``, ``role: "tool"`` results). A plain ChatML template (SmolLM2, the
project's presets) does not, so the same information is written as text in the Hermes format the
output parser reads back (tool_spec.py):

    system     ...the tools' JSON signatures inside <tools></tools>, and how to call them
    assistant  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    tool       <tool_response>\\n{"name": ..., "content": ...}\\n</tool_response>
"""
from __future__ import annotations

import json
from typing import Any

from backend.errors import invalid_request
from backend.errors import InvalidSamplingParam
from backend.structured.tool_spec import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tools

KEPT_FIELDS = ("tool_calls", "tool_call_id", "name")


def tools_from_params(params: dict) -> list[dict] | None:
    """The request's tools to show the model (None: none given, or tool_choice "none")."""
    tools = params.get("tools")
    if tools in (None, "", []) or params.get("tool_choice") == "none":
        return None
    try:
        return parse_tools(tools)
    except InvalidSamplingParam as exc:
        raise invalid_request(exc.param, str(exc)) from None


def _openai_tools(tools: list[dict]) -> list[dict]:
    return [{"type": "function", "function": t} for t in tools]


def template_supports_tools(tokenizer: Any) -> bool:
    return "tools" in str(getattr(tokenizer, "chat_template", "") or "")


def template_inputs(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], dict]:
    """(messages, extra apply_chat_template kwargs) for this tokenizer's template."""
    if template_supports_tools(tokenizer):
        return messages, ({"tools": _openai_tools(tools)} if tools else {})
    has_tool_messages = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_tool_messages:
        return [{"role": m["role"], "content": m["content"]} for m in messages], {}
    out = [_as_text(m, messages) for m in messages]
    if tools:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def system_prompt(tools: list[dict]) -> str:
    sigs = "\n".join(json.dumps(t) for t in _openai_tools(tools))
    return ("You can call functions. Their signatures are inside <tools></tools>:\n"
            f"<tools>\n{sigs}\n</tools>\n"
            "To call a function, answer with its name and arguments as JSON inside "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags:\n"
            f'{TOOL_CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{TOOL_CALL_CLOSE}')


def _as_text(m: dict, messages: list[dict]) -> dict:
    if m.get("tool_calls"):
        parts = [m["content"]] if m.get("content") else []
        for call in m["tool_calls"]:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            parts.append(f"{TOOL_CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n"
                         f"{TOOL_CALL_CLOSE}")
        return {"role": "assistant", "content": "\n".join(parts)}
    if m["role"] == "tool":
        name = m.get("name") or _call_name(m.get("tool_call_id"), messages)
        body = json.dumps({"name": name, "content": m["content"]})
        return {"role": "tool", "content": f"<tool_response>\n{body}\n</tool_response>"}
    return {"role": m["role"], "content": m["content"]}


def _call_name(call_id: Any, messages: list[dict]) -> str | None:
    for m in messages:
        for call in m.get("tool_calls") or ():
            if isinstance(call, dict) and call.get("id") == call_id:
                return call.get("function", {}).get("name")
    return None
