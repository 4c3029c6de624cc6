"""``POST /v1/responses`` bodies and their translation to a chat request (one generation path).

    Responses body ──to_chat()──► ChatCompletionRequest ──► the chat route's params, messages, grammar

As OpenAI's API does, an unknown field is a 400 naming it; fields of features served elsewhere or
not at all (``background``, ``conversation``, stored ``prompt`` templates, built-in tools, image or
file input) are a 400 naming the field, never silently dropped. Accepted and without effect here:
``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``, ``service_tier``,
``truncation``, ``include``, ``reasoning`` (the model decides how much it thinks), ``max_tool_calls``,
``stream_options``. vLLM-style extras: ``top_k``, ``min_p``, ``seed``, penalties, ``priority``,
``include_reasoning``, ``guided_regex``, ``ignore_eos``, ``min_tokens``.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.shim import limits as L
from client.shim.errors import invalid
from client.shim.schemas import ChatCompletionRequest, Finite, Int64, Positive

MAX_INPUT_ITEMS = 4096
UNSUPPORTED = ("conversation", "prompt", "context_management", "moderation", "image",
               "background_options", "prompt_cache_options", "access_programs")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    input: Union[str, list[dict[str, Any]]] = Field(...)
    instructions: str | None = None
    max_output_tokens: Positive | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: Positive | None = None
    top_logprobs: int | None = Field(None, ge=0, le=L.MAX_LOGPROBS)
    # vLLM-style extras
    top_k: int | None = Field(None, ge=-1, le=L.INT32_MAX)
    min_p: Finite | None = None
    seed: Int64 | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    priority: int | None = Field(None, ge=L.PRIORITY_MIN, le=L.PRIORITY_MAX)
    include_reasoning: bool = True
    guided_regex: str | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=L.INT64_MAX)
    # refused with a 400 naming them when given (check_supported)
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None
    access_programs: Any = None

    def check_supported(self) -> None:
        if self.background:
            raise invalid("background mode is not supported: send background: false or leave it out",
                          "background")
        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                raise invalid(f"'{name}' is not supported by this server", name)
        if self.top_logprobs:
            raise invalid("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                          "top_logprobs")
        if isinstance(self.input, list) and not 1 <= len(self.input) <= MAX_INPUT_ITEMS:
            raise invalid(f"input holds 1 to {MAX_INPUT_ITEMS} items, got {len(self.input)}", "input")

    def param_names(self) -> dict[str, str]:
        return {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                "request_priority": "priority", "tool_choice": "tool_choice", "tools": "tools"}


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools -> chat's ``{"type": "function", "function": {...}}``."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if kind != "function":
            raise invalid(f"tools[{i}]: built-in tool type {kind!r} is not supported; only "
                          "function tools are", f"tools.{i}.type")
        if not isinstance(t.get("name"), str):
            raise invalid(f"tools[{i}].name must be a string", f"tools.{i}.name")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if t.get("strict") is not None:
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(f"tool_choice of type {choice.get('type')!r} is not supported (a string or "
                  '{"type": "function", "name": ...})', "tool_choice")


def chat_response_format(text: dict | None) -> dict | None:
    """``text.format`` -> chat's ``response_format`` (json_schema goes through the grammar)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema must be a JSON schema object", "text.format.schema")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return {"type": fmt["type"]}


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text") \
                and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        else:
            raise invalid(f"{where}.{j}: part type {kind!r} is not supported (text parts only)",
                          f"{where}.{j}.type")
    return "".join(parts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input -> chat messages. Function calls echoed back join the assistant turn that
    made them; their outputs become ``tool`` messages; reasoning items are dropped (a chat template
    does not show old thinking)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"input[{i}].role must be user, system, developer or assistant", f"input.{i}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise invalid(f"input[{i}]: a function_call needs string call_id, name and arguments", f"input.{i}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"input[{i}].call_id must be a string", f"input.{i}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text_of(item.get("output"), f"input.{i}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise invalid(f"input[{i}]: item type {kind!r} is not supported", f"input.{i}.type")
    if not out:
        raise invalid("input has no message", "input")
    return out


def to_chat(body: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request for ``body`` after ``history`` (a stored conversation, or []), and the
    conversation without instructions (what a stored response keeps)."""
    conversation = history + input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                            "max_completion_tokens": body.max_output_tokens,
                            "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
                            "parallel_tool_calls": body.parallel_tool_calls,
                            "response_format": chat_response_format(body.text)}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "priority", "guided_regex", "ignore_eos", "min_tokens"):
        chat[name] = getattr(body, name)
    try:
        return ChatCompletionRequest(**{k: v for k, v in chat.items() if v is not None}), conversation
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid(f"input: {first.get('msg', 'invalid')}", "input") from None
