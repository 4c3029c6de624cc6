"""OpenAI ``tools`` / ``tool_choice`` -> the tool-call output format and its grammar.

Tool calls are written Hermes-style, the format ChatML tool-calling models (Hermes, Qwen2.5) use
and that ``client/shim/tools.py`` parses back into ``message.tool_calls``::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` "none" / "auto" constrain nothing (auto: the shim parses whatever calls the model
writes). "required" and a named function constrain the output to one or more (one when
``parallel_tool_calls`` is false) such blocks, each with a tool's name and arguments that follow
its ``parameters`` schema, so they always parse: an xgrammar structural tag where the fixed text
(``<tool_call>\\n{"name": "...", "arguments": ``) is the tag's begin and the arguments a JSON
schema.
"""
from __future__ import annotations

import json
from typing import Any

from backend.errors import InvalidSamplingParam

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _load(v: Any, param: str) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except RecursionError:
            raise InvalidSamplingParam(param, f"{param} nests too deeply") from None
        except ValueError:
            if param == "tool_choice":
                return v                     # "none" / "auto" / "required" as bare words
            raise InvalidSamplingParam(param, f"{param} is not valid JSON") from None
    return v


def parse_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools`` -> [{"name", "description", "parameters"}], validated."""
    tools = _load(tools, "tools")
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise InvalidSamplingParam("tools", f"tools must be a list of 1 to {MAX_TOOLS} function tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidSamplingParam("tools", f'tools[{i}] must be {{"type": "function", "function": {{"name", ...}}}}')
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if params is None:
            params = EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise InvalidSamplingParam("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        if fn["name"] in names:
            raise InvalidSamplingParam("tools", f"tools[{i}]: duplicate function name {fn['name']!r}")
        names.add(fn["name"])
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": params})
    return out


def parse_tool_choice(choice: Any, tools: list[dict]) -> str | None:
    """None/"none"/"auto" -> None; "required" -> "required"; a named function -> its name."""
    choice = _load(choice, "tool_choice")
    if choice is None or choice in ("none", "auto"):
        return None
    if choice == "required":
        return "required"
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in {t["name"] for t in tools}:
            return name
        raise InvalidSamplingParam("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
    raise InvalidSamplingParam("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                              '{"type": "function", "function": {"name": ...}}')


def tool_call_begin(name: str) -> str:
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


def structural_tag(value: str):
    """xgrammar StructuralTag for a ``tool_calls`` spec value: the calls' tags, one or (with
    parallel calls) more, separated by a newline, nothing else."""
    from xgrammar.structural_tag import (JSONSchemaFormat, StructuralTag, TagFormat,
                                         TagsWithSeparatorFormat)

    v = json.loads(value)
    # max_whitespace_cnt bounds whitespace inside the arguments: a model (or random weights) that
    # favours spaces could otherwise never reach the end of an object.
    tags = [TagFormat(begin=tool_call_begin(t["name"]),
                      content=JSONSchemaFormat(json_schema=t["parameters"], max_whitespace_cnt=1),
                      end=f"}}\n{TOOL_CALL_CLOSE}")
            for t in v["tools"]]
    return StructuralTag(format=TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                                        stop_after_first=not v["parallel"]))
