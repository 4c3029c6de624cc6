"""What the chat store accepts: conversation settings and the errors it raises (404 / 400)."""
from __future__ import annotations

POLICIES = ("truncate", "summarize")
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
        if not isinstance(title, str) or not title.strip() or len(title) > 200:
            raise Invalid("title must be a non-empty string of at most 200 characters", "title")
        out["title"] = title.strip()
    if "system_prompt" in fields:
        if not isinstance(fields["system_prompt"], str):
            raise Invalid("system_prompt must be a string", "system_prompt")
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
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            else:
                numeric = (int, float) if kind is float else (int,)
                ok = isinstance(value, numeric) and not isinstance(value, bool)
            if not ok:
                raise Invalid(f"params.{key} must be of type {kind.__name__}", "params")
        out["params"] = dict(params)
    return out
