"""Which model served a request: the per-request fallback opt-in and the response's model name.

``ServedModel`` is an ASGI middleware around the shim app in the ingress (the shim is unchanged):

- it reads the per-request opt-in header ``x-allow-fallback: 1`` into a per-request record that
  ``ServeClient`` (same request, a context variable) reads and fills in with the deployment it
  chose ("primary" | "fallback") and why;
- every response of a generation route gets ``x-served-model: <name>`` (and, when degraded,
  ``x-fallback-reason``); the decision is made before the shim sends a response's first byte
  (the shim waits for the first chunk before it starts a stream);
- a response served by the fallback says so in its body too: the top-level ``model`` of the JSON
  response, or of every SSE ``data:`` event, is the fallback model's name instead of the
  requested one.
"""
from __future__ import annotations

import contextvars
import json

from common.env import TRUE

ALLOW_HEADER = b"x-allow-fallback"
MODEL_HEADER = b"x-served-model"
REASON_HEADER = b"x-fallback-reason"
ROUTES = ("/v1/chat/completions", "/v1/completions")

SERVED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tllm_served", default=None)


def new_record(allow_fallback: bool = False) -> dict:
    return {"allow_fallback": allow_fallback, "label": None, "reason": None}


def truthy(value: str | bytes | None) -> bool:
    """A header's flag in common/env.py's dialect; anything else (absent, garbled) is false."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return str(value or "").strip().lower() in TRUE


def _rename(obj, name: str):
    if isinstance(obj, dict) and "model" in obj:
        obj["model"] = name
    return obj


def rename_json(body: bytes, name: str) -> bytes:
    try:
        return json.dumps(_rename(json.loads(body), name), ensure_ascii=False,
                          separators=(",", ":")).encode()
    except ValueError:
        return body


def rename_sse(chunk: bytes, name: str) -> bytes:
    """Each ``data: {...}`` line's top-level model (the shim sends whole events per chunk)."""
    out = []
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                line = b"data: " + json.dumps(_rename(json.loads(line[6:]), name),
                                              ensure_ascii=False).encode()
            except ValueError:
                pass
        out.append(line)
    return b"\n".join(out)


class ServedModel:
    def __init__(self, app, *, primary_name: str, fallback_name: str | None) -> None:
        self.app, self.primary_name, self.fallback_name = app, primary_name, fallback_name

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in ROUTES:
            return await self.app(scope, receive, send)
        allow = truthy(dict(scope.get("headers") or []).get(ALLOW_HEADER))
        record = new_record(allow)
        token = SERVED.set(record)
        state = {"mode": None, "start": None, "body": []}

        async def wrapped(msg):
            if msg["type"] == "http.response.start":
                degraded = record["label"] == "fallback" and self.fallback_name
                headers = [(k, v) for k, v in msg.get("headers", [])]
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if record["label"]:
                    name = self.fallback_name if degraded else self.primary_name
                    headers.append((MODEL_HEADER, name.encode()))
                    if degraded and record["reason"]:
                        headers.append((REASON_HEADER, record["reason"].encode()))
                msg = {**msg, "headers": headers}
                if degraded and ctype.startswith(b"text/event-stream"):
                    state["mode"] = "sse"
                elif degraded and ctype.startswith(b"application/json"):
                    state["mode"], state["start"] = "json", msg      # sent with the rewritten body
                    return
                return await send(msg)
            if msg["type"] == "http.response.body" and state["mode"] == "sse":
                msg = {**msg, "body": rename_sse(msg.get("body", b""), self.fallback_name)}
            elif msg["type"] == "http.response.body" and state["mode"] == "json":
                state["body"].append(msg.get("body", b""))
                if msg.get("more_body"):
                    return
                body = rename_json(b"".join(state["body"]), self.fallback_name)
                start = state["start"]
                headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                msg = {"type": "http.response.body", "body": body, "more_body": False}
            await send(msg)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            SERVED.reset(token)
