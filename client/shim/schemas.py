"""OpenAI request bodies (pydantic). Unknown fields are ignored, as OpenAI's own API does.

The shape is checked here (types; a wrong type is a 400 naming the field), and so are the bounds
that limit the shim's own work or that the gRPC wire cannot carry (client/shim/limits.py): ``n``,
the prompt list, integers (int64 and each one's range: ``max_tokens: 2**63`` is a 400 here, not a
500 from the gRPC library), finite floats, stop strings. Every other value range is checked on the
server (backend/serving/intake.py) and comes back as a tagged error.
Server-side parameter names are backend/protocol.py's.
"""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backend import protocol as P
from client.shim import limits as L
from client.shim.tools import structured_params

Int64 = Annotated[int, Field(ge=L.INT64_MIN, le=L.INT64_MAX)]
Positive = Annotated[int, Field(ge=1, le=L.INT64_MAX)]
NonNegative = Annotated[int, Field(ge=0, le=L.INT64_MAX)]
Logprobs = Annotated[int, Field(ge=0, le=L.MAX_LOGPROBS)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=L.INT32_MAX)]
# Fields that ask for structured output (tools.py turns them into parameters; others skip it).
STRUCTURED_FIELDS = ("tools", "tool_choice", "response_format", "logit_bias", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=L.MAX_N)] | None = None
    max_tokens: Positive | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: Annotated[int, Field(ge=-1, le=L.INT32_MAX)] | None = None
    min_p: Finite | None = None
    seed: Int64 | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=L.MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: NonNegative | None = None
    ignore_eos: bool | None = None
    # vLLM's extension: lower = sooner. The key's own priority is the most urgent it may ask for.
    priority: Annotated[int, Field(ge=L.PRIORITY_MIN, le=L.PRIORITY_MAX)] | None = None
    user: str | None = None
    # Structured outputs (vLLM's guided_* as extras): sent by client/shim/tools.py, checked by the server.
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > L.MAX_STOP:
            raise ValueError(f"at most {L.MAX_STOP} stop strings, got {len(items)}")
        if any(len(s) > L.MAX_STOP_CHARS for s in items):
            raise ValueError(f"a stop string has at most {L.MAX_STOP_CHARS} characters")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def common_params(self) -> dict[str, Any]:
        p: dict[str, Any] = {}
        # body field == server parameter name (priority: the client sends it as request_priority)
        for name in (P.N, P.TEMPERATURE, P.TOP_P, P.TOP_K, P.MIN_P, P.SEED, P.PRESENCE_PENALTY,
                     P.FREQUENCY_PENALTY, P.REPETITION_PENALTY, P.STOP_TOKEN_IDS, P.MIN_TOKENS,
                     P.IGNORE_EOS, "priority"):
            value = getattr(self, name)
            if value is not None:
                p[name] = value
        if self.stop is not None:
            stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
            if stop:
                p[P.STOP] = stop
        if any(getattr(self, f, None) is not None for f in STRUCTURED_FIELDS):
            p.update(structured_params(self))
        return p


class ChatMessage(_Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None      # assistant turns that called tools
    tool_call_id: str | None = None                     # role "tool": the call it answers


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True          # vLLM's: false drops the thinking (--reasoning-parser)

    def prompt_chars(self) -> int:
        """Characters of every message's text together (what the chat template will wrap)."""
        total = 0
        for m in self.messages:
            total += len(m.role) + len(m.name or "")
            if isinstance(m.content, str):
                total += len(m.content)
            elif isinstance(m.content, list):
                total += sum(len(str(part.get("text", ""))) for part in m.content)
        return total

    def messages_json(self) -> list[dict]:
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name is not None:
                d["name"] = m.name
            for k in ("tool_calls", "tool_call_id"):
                if getattr(m, k) is not None:
                    d[k] = getattr(m, k)
            out.append(d)
        return out

    def params(self) -> dict[str, Any]:
        p = self.common_params()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None:          # omitted: the rest of the context window
            p[P.MAX_TOKENS] = max_tokens
        if self.logprobs:
            p[P.LOGPROBS_PARAM] = self.top_logprobs or 0
        return p

    def param_names(self) -> dict[str, str]:
        """Server-side parameter names -> this request's field names (for 400 ``param``)."""
        names = {P.LOGPROBS_PARAM: "top_logprobs" if self.top_logprobs is not None else "logprobs",
                 P.REQUEST_PRIORITY: "priority"}
        if self.max_completion_tokens is not None:
            names[P.MAX_TOKENS] = "max_completion_tokens"
        return names


class CompletionRequest(_Generation):
    prompt: Union[str, list[str]]
    logprobs: Logprobs | None = None
    echo: bool | None = None                # accepted, not supported (ignored)
    suffix: str | None = None               # accepted, ignored

    @field_validator("prompt")
    @classmethod
    def _bounded_prompts(cls, v):
        if isinstance(v, list) and not 1 <= len(v) <= L.MAX_PROMPTS:
            raise ValueError(f"a prompt list holds 1 to {L.MAX_PROMPTS} prompts, got {len(v)}")
        return v

    def prompt_chars(self) -> int:
        """The longest prompt's characters (each prompt is tokenized on its own)."""
        return max(len(p) for p in self.prompts())

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def params(self) -> dict[str, Any]:
        p = self.common_params()
        if self.max_tokens is not None:     # omitted: the rest of the context window
            p[P.MAX_TOKENS] = self.max_tokens
        if self.logprobs is not None:
            p[P.LOGPROBS_PARAM] = self.logprobs
        return p

    def param_names(self) -> dict[str, str]:
        return {P.TEXT_INPUT: "prompt", P.REQUEST_PRIORITY: "priority"}
