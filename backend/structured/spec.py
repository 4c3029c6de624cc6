"""What a request constrains its output to: ``StructuredSpec`` and its parsing from request fields.

One spec per request, from exactly one of these request parameters (OpenAI's and vLLM's names)::

    response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
    guided_json       a JSON schema (object or JSON text)
    guided_regex      a regular expression the whole output matches
    guided_choice     a list of strings; the output is exactly one of them
    guided_grammar    an EBNF grammar (xgrammar's dialect, ``root ::= ...``)
    tools + tool_choice "required" | {"type": "function", "function": {"name": ...}}
                      Hermes-style <tool_call> blocks whose JSON follows the functions' schemas

The spec is plain, hashable data (``kind``, canonical ``value`` text): the grammar cache keys on
it (compiler.py). Shape errors and the compile caps (caps.py: sizes, repetition bounds, nesting)
raise ``InvalidSamplingParam`` naming the field when the spec is made; whether a schema or regex
compiles is only known to the compiler, which raises the same error. Once compiled off the
engine's path, a request's spec carries its grammar (``with_grammar``; not a field: never
compared, hashed or serialized).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from backend.errors import InvalidSamplingParam
from backend.structured.caps import MAX_CHARS, check_spec
from backend.structured.tool_spec import parse_tool_choice, parse_tools

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls")
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_SPEC_CHARS = max(MAX_CHARS.values())   # the largest text any kind may have (caps.py: per kind)
LOGIT_BIAS_MAX = 100.0               # OpenAI: each bias in [-100, 100]
LOGIT_BIAS_MAX_ENTRIES = 1024


@dataclass(frozen=True)
class StructuredSpec:
    kind: str          # one of KINDS
    value: str         # schema JSON / regex / JSON list of choices / EBNF / tool-call JSON
    param: str         # the request field it came from (names the field in a 400)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidSamplingParam(self.param, f"unknown structured output kind {self.kind!r}")
        if not isinstance(self.value, str):
            raise InvalidSamplingParam(self.param, f"{self.param} must be text")
        check_spec(self.kind, self.value, self.param)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.value

    def with_grammar(self, grammar: Any) -> "StructuredSpec":
        """This spec carrying its compiled grammar (compiler.py), so the engine thread never
        compiles or waits for a cache: an attribute, not a field (asdict and == ignore it)."""
        out = copy.copy(self)
        object.__setattr__(out, "compiled_grammar", grammar)
        return out

    # -- constructors for the offline API -----------------------------------------------
    @classmethod
    def json(cls, schema: dict | str | None = None) -> "StructuredSpec":
        """A JSON schema (dict, JSON text, or a pydantic model class); None = any JSON object."""
        if schema is None:
            return cls("json_object", "", "response_format")
        if hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        return cls("json_schema", _schema_text(schema, "guided_json"), "guided_json")

    @classmethod
    def regex(cls, pattern: str) -> "StructuredSpec":
        _text(pattern, "guided_regex")
        return cls("regex", pattern, "guided_regex")

    @classmethod
    def choice(cls, options: list[str]) -> "StructuredSpec":
        return cls("choice", json.dumps(_choices(options)), "guided_choice")

    @classmethod
    def grammar(cls, ebnf: str) -> "StructuredSpec":
        _text(ebnf, "guided_grammar")
        return cls("grammar", ebnf, "guided_grammar")


def _text(v: Any, param: str) -> str:
    if not isinstance(v, str) or not v:
        raise InvalidSamplingParam(param, f"{param} must be a non-empty string")
    return v


def _choices(v: Any) -> list[str]:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):
            raise InvalidSamplingParam("guided_choice", "guided_choice must be a JSON list of strings") from None
    if not isinstance(v, list) or not v or any(not isinstance(c, str) or not c for c in v):
        raise InvalidSamplingParam("guided_choice", "guided_choice must be a non-empty list of non-empty strings")
    return v


def _load_json(v: Any, param: str) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except RecursionError:
            raise InvalidSamplingParam(param, f"{param} nests too deeply") from None
        except ValueError as exc:
            raise InvalidSamplingParam(param, f"{param} is not valid JSON: {exc}") from None
    return v


def _schema_text(schema: Any, param: str) -> str:
    schema = _load_json(schema, param)
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise InvalidSamplingParam(param, f"{param} must be a JSON schema object")
    return json.dumps(schema)            # key order kept: it is the order properties are generated in


def response_format_spec(v: Any) -> StructuredSpec | None:
    """OpenAI ``response_format`` -> spec (None for ``{"type": "text"}``)."""
    param = "response_format"
    v = _load_json(v, param)
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise InvalidSamplingParam(param, 'response_format must be an object with a "type"')
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "", param)
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise InvalidSamplingParam(param, 'response_format json_schema needs {"json_schema": {"name", "schema"}}')
        return StructuredSpec("json_schema", _schema_text(js["schema"], param), param)
    raise InvalidSamplingParam(param, f"response_format type must be text, json_object or json_schema, got {kind!r}")


def spec_from_params(p: dict) -> StructuredSpec | None:
    """The one structured-output spec of a request's parameters (None when unconstrained).
    Raises InvalidSamplingParam when several are given or one is malformed."""
    found: list[StructuredSpec] = []
    if p.get("response_format") not in (None, ""):
        spec = response_format_spec(p["response_format"])
        if spec is not None:
            found.append(spec)
    if p.get("guided_json") not in (None, ""):
        found.append(StructuredSpec("json_schema", _schema_text(p["guided_json"], "guided_json"), "guided_json"))
    if p.get("guided_regex") not in (None, ""):
        found.append(StructuredSpec("regex", _text(p["guided_regex"], "guided_regex"), "guided_regex"))
    if p.get("guided_choice") not in (None, ""):
        found.append(StructuredSpec("choice", json.dumps(_choices(p["guided_choice"])), "guided_choice"))
    if p.get("guided_grammar") not in (None, ""):
        found.append(StructuredSpec("grammar", _text(p["guided_grammar"], "guided_grammar"), "guided_grammar"))
    tools = tool_calls_spec(p.get("tools"), p.get("tool_choice"), p.get("parallel_tool_calls"))
    if tools is not None:
        found.append(tools)
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise InvalidSamplingParam(found[1].param, f"only one output constraint per request, got {names}")
    return found[0] if found else None


def parse_logit_bias(v: Any) -> dict[int, float] | None:
    """OpenAI ``logit_bias``: {token id (int or its decimal text): bias in [-100, 100]}."""
    param = "logit_bias"
    v = _load_json(v, param)
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise InvalidSamplingParam(param, "logit_bias must be an object mapping token ids to biases")
    if len(v) > LOGIT_BIAS_MAX_ENTRIES:
        raise InvalidSamplingParam(param, f"logit_bias has at most {LOGIT_BIAS_MAX_ENTRIES} entries")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise InvalidSamplingParam(param, f"logit_bias key {k!r} is not a token id") from None
        if tid < 0 or isinstance(k, bool):
            raise InvalidSamplingParam(param, f"logit_bias key {k!r} is not a token id")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX:
            raise InvalidSamplingParam(param, f"logit_bias values must be numbers in [-100, 100], got {b!r}")
        out[tid] = float(b)
    return out


def check_structured(spec: Any, logit_bias: Any) -> dict[int, float] | None:
    """SamplingParams.validate()'s part: the spec's type, and logit_bias normalised."""
    if spec is not None and not isinstance(spec, StructuredSpec):
        raise InvalidSamplingParam("structured", f"structured must be a StructuredSpec, got {type(spec).__name__}")
    return parse_logit_bias(logit_bias)


def tool_calls_spec(tools: Any, tool_choice: Any, parallel: Any):
    """The StructuredSpec for ``required`` / named tool choice, else None."""
    if tools in (None, "", []):
        if tool_choice not in (None, "", "none", "auto"):
            raise InvalidSamplingParam("tool_choice", "tool_choice needs tools")
        return None
    parsed = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, parsed)
    if choice is None:
        return None
    if choice != "required":
        parsed = [t for t in parsed if t["name"] == choice]
    if isinstance(parallel, str):
        parallel = parallel.strip().lower() not in ("false", "0", "no")
    value = {"tools": [{"name": t["name"], "parameters": t["parameters"]} for t in parsed],
             "parallel": bool(True if parallel is None else parallel) and choice == "required"}
    return StructuredSpec("tool_calls", json.dumps(value), "tool_choice")
