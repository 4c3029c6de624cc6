"""What the chat store accepts: conversation settings and the errors it raises (404 / 400)."""
from __future__ import annotations

import json

from common.param_codec import INT64_MAX, INT64_MIN

POLICIES = ("truncate", "summarize")
# Size caps: what one request may make the store keep (the shim's body limit bounds the request).
MAX_TITLE_CHARS = 200
MAX_SYSTEM_PROMPT_CHARS = 32_000
MAX_CONTENT_CHARS = 200_000
MAX_JSON_CHARS = 16_000          # a message's stats / context note, as JSON
# Sampling fields a conversation may forward to /v1/chat/completions (its "params" setting).
ALLOWED_PARAMS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
                  "presence_penalty": float, "frequency_penalty": float,
                  "repetition_penalty": float, "ignore_eos": bool, "stop": list}


class NotFound(LookupError):
    """No such conversation or message for this tenant (HTTP 404)."""


class Invalid(ValueError):
    """A request the store refuses: bad field value or an impossible tree edit (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def validate_settings(fields: dict) -> dict:
    """Check conversation settings from a request; returns the normalized subset (raises Invalid)."""
    out: dict = {}
    if "title" in fields:
        title = fields["title"]
        if not isinstance(title, str) or not title.strip() or len(title) > MAX_TITLE_CHARS:
            raise Invalid(f"title must be a non-empty string of at most {MAX_TITLE_CHARS} characters",
                          "title")
        out["title"] = title.strip()
    if "system_prompt" in fields:
        if not isinstance(fields["system_prompt"], str):
            raise Invalid("system_prompt must be a string", "system_prompt")
        if len(fields["system_prompt"]) > MAX_SYSTEM_PROMPT_CHARS:
            raise Invalid(f"system_prompt has at most {MAX_SYSTEM_PROMPT_CHARS} characters",
                          "system_prompt")
        out["system_prompt"] = fields["system_prompt"]
    if "policy" in fields:
        if fields["policy"] not in POLICIES:
            raise Invalid(f"policy must be one of {', '.join(POLICIES)}", "policy")
        out["policy"] = fields["policy"]
    if "keep_turns" in fields:
        n = fields["keep_turns"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1000:
            raise Invalid("keep_turns must be an integer from 1 to 1000", "keep_turns")
        out["keep_turns"] = n
    if "max_tokens" in fields:
        n = fields["max_tokens"]
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise Invalid("max_tokens must be a positive integer or null", "max_tokens")
        out["max_tokens"] = n
    if "params" in fields:
        params = fields["params"]
        if isinstance(params, dict) and len(params) > len(ALLOWED_PARAMS):
            raise Invalid("params has too many fields", "params")
        if not isinstance(params, dict):
            raise Invalid("params must be an object", "params")
        for key, value in params.items():
            kind = ALLOWED_PARAMS.get(key)
            if kind is None:
                raise Invalid(f"params.{key} is not supported; allowed: {', '.join(ALLOWED_PARAMS)}",
                              "params")
            if kind is bool:
                ok = isinstance(value, bool)
            elif kind is list:
                ok = (isinstance(value, list) and len(value) <= 4
                      and all(isinstance(v, str) and len(v) <= 256 for v in value))
            else:
                numeric = (int, float) if kind is float else (int,)
                ok = (isinstance(value, numeric) and not isinstance(value, bool)
                      and INT64_MIN <= value <= INT64_MAX and value == value)
            if not ok:
                raise Invalid(f"params.{key} must be of type {kind.__name__}", "params")
        out["params"] = dict(params)
    return out


def validate_message(content, stats, context) -> None:
    """Size and type caps of a message (roles and the tree are the store's to check)."""
    if not isinstance(content, str):
        raise Invalid("content must be a string", "content")
    if len(content) > MAX_CONTENT_CHARS:
        raise Invalid(f"content has at most {MAX_CONTENT_CHARS} characters", "content")
    for name, value in (("stats", stats), ("context", context)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise Invalid(f"{name} must be an object", name)
        try:
            size = len(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError):
            raise Invalid(f"{name} must be plain JSON", name) from None
        if size > MAX_JSON_CHARS:
            raise Invalid(f"{name} has at most {MAX_JSON_CHARS} characters of JSON", name)
