"""OpenAI request bodies (pydantic). Unknown fields are ignored, as OpenAI's own API does.

Only the shape is checked here (types; a wrong type is a 400 naming the field). Value ranges are
checked once, on the server (backend/serving/request_params.py), and come back as tagged errors.
Server-side parameter names are backend/protocol.py's.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from backend import protocol as P


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    priority: int | None = None             # vLLM's extension: lower = sooner
    user: str | None = None

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
        return p


class ChatMessage(_Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def messages_json(self) -> list[dict]:
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name is not None:
                d["name"] = m.name
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
    logprobs: int | None = None
    echo: bool | None = None                # accepted, not supported (ignored)
    suffix: str | None = None               # accepted, ignored

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
