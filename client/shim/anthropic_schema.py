"""``POST /v1/messages`` (Anthropic Messages) bodies and their translation to a chat request.

    system + messages (text, tool_use, tool_result blocks) ──to_chat()──► ChatCompletionRequest

As Anthropic's API does, an unknown field is a 400 naming it. Image, document and server-tool
blocks, built-in (server) tools, MCP servers and containers are a 400 naming the field. Accepted
without effect: ``metadata``, ``service_tier``, ``cache_control``, ``output_config.effort``,
``speed``, ``inference_geo``. ``thinking``: with ``--reasoning-parser``, thinking blocks are returned
when it is ``{"type": "enabled", ...}`` (or ``adaptive``), and dropped otherwise.
"""
from __future__ import annotations

import json
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.shim import limits as L
from client.shim.errors import invalid
from client.shim.schemas import ChatCompletionRequest, Finite, Positive

MAX_MESSAGES = 4096


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: Positive
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[str] | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: int | None = Field(None, ge=-1, le=L.INT32_MAX)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    inference_geo: str | None = None
    # refused when given (check_supported)
    container: Any = None
    mcp_servers: Any = None
    diagnostics: Any = None

    def check_supported(self) -> None:
        for name in ("container", "mcp_servers", "diagnostics"):
            if getattr(self, name) is not None:
                raise invalid(f"{name}: not supported by this server", name)

    @property
    def wants_thinking(self) -> bool:
        return (self.thinking or {}).get("type") in ("enabled", "adaptive")

    def param_names(self) -> dict[str, str]:
        return {"stop": "stop_sequences", "messages": "messages", "response_format": "output_config.format",
                "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens"}


def _text(block: dict, where: str) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise invalid(f"{where}: block type {block.get('type')!r} is not supported here (text blocks only)",
                      f"{where}.type")
    return block["text"]


def _system(system) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "".join(_text(b, f"system.{i}") for i, b in enumerate(system)) or None


def _tool_result(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text(b, f"{where}.content.{j}") for j, b in enumerate(content))
    elif not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or text blocks", f"{where}.content")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _message(m: dict, i: int) -> list[dict]:
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise invalid(f"messages.{i}.role must be 'user' or 'assistant'", f"messages.{i}.role")
    if set(m) - {"role", "content"}:
        extra = sorted(set(m) - {"role", "content"})[0]
        raise invalid(f"messages.{i}.{extra}: Extra inputs are not permitted", f"messages.{i}.{extra}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"messages.{i}.content must be a string or a list of content blocks", f"messages.{i}.content")
    texts, calls, results = [], [], []
    for j, b in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text(b, where))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                    or not isinstance(b.get("input"), dict):
                raise invalid(f"{where}: tool_use needs string id and name and an object input", where)
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(b, where))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue                                # a chat template does not show old thinking
        else:
            raise invalid(f"{where}: block type {kind!r} is not supported in a {role} message", f"{where}.type")
    if role == "assistant":
        msg: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom") or "input_schema" not in t:
            raise invalid(f"tools.{i}: server tool {t.get('type')!r} is not supported; only custom tools "
                          "(name, description, input_schema) are", f"tools.{i}.type")
        if not isinstance(t.get("name"), str):
            raise invalid(f"tools.{i}.name must be a string", f"tools.{i}.name")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice -> (chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise invalid("tool_choice.type must be auto, any, tool (with a name) or none", "tool_choice")


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    messages = [{"role": "system", "content": s}] if (s := _system(body.system)) else []
    for i, m in enumerate(body.messages):
        if not isinstance(m, dict):
            raise invalid(f"messages.{i} must be an object with role and content", f"messages.{i}")
        messages += _message(m, i)
    choice, parallel = chat_tool_choice(body.tool_choice)
    fmt = (body.output_config or {}).get("format")
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                            "max_completion_tokens": body.max_tokens, "stop": body.stop_sequences or None,
                            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                            "tools": chat_tools(body.tools), "tool_choice": choice, "parallel_tool_calls": parallel}
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise invalid("output_config.format must be {type: json_schema, schema: {...}}", "output_config.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    try:
        return ChatCompletionRequest(**{k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if isinstance(p, (str, int)))
        param = {"stop": "stop_sequences"}.get(loc.split(".")[0], loc.split(".")[0] or None)
        raise invalid(f"{param}: {first.get('msg', 'invalid')}", param) from None
