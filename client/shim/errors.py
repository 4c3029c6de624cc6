"""The shim's error answers, with the right status: OpenAI's shape ``{"error": {"message", "type",
"param", "code"}}``, and on ``/v1/messages`` (client/shim/anthropic.py) Anthropic's ``{"type":
"error", "error": {"type", "message"}}``. Every check (body limit, auth, validation, the routes,
server errors) raises or sends an :class:`OpenAIError`; the request's path picks the shape, so no
other request passes through the Anthropic route's code."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.errors import InvalidRequestError, QueueFullError, TritonLLMError, UnavailableError

log = logging.getLogger("triton_llm.shim")
ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATH)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self, path: str = "") -> dict:
        """The error in the shape of the API that ``path`` belongs to."""
        if is_anthropic(path):              # Anthropic's has no param: named in the message
            named = self.param and self.param not in self.message
            return anthropic_body(self.status, f"{self.param}: {self.message}" if named else self.message)
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def sse(self) -> str:
        """The stream's error event (a stream that fails never ends with ``[DONE]``)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY'.") -> OpenAIError:
    return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist or you do not have access to it.",
                       "invalid_request_error", "model", "model_not_found")


def not_ready(message: str = "The model is not ready; try again shortly.") -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable_error", None, "service_unavailable",
                       {"Retry-After": "1"})


def from_llm_error(exc: TritonLLMError, param_names: dict[str, str] | None = None) -> OpenAIError:
    """A typed client error -> its OpenAI error; ``param_names`` renames server-side params
    (e.g. ``text_input`` -> ``prompt``, ``max_tokens`` -> ``max_completion_tokens``)."""
    if isinstance(exc, InvalidRequestError):
        param = exc.param
        if param and param_names:
            param = param_names.get(param, param)
        return invalid(exc.message, param)
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, f"The server is overloaded: {exc.message}", "rate_limit_error", None,
                           "rate_limit_exceeded", {"Retry-After": str(exc.retry_after)})
    if isinstance(exc, UnavailableError):
        return not_ready(exc.message)
    return OpenAIError(500, exc.message, "server_error", None, "internal_error")


def _validation_param(loc) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages.0.role``; pydantic's union-member tags
    (``str``, ``list[str]``, ``function-after[...]``) are not fields and are left out."""
    parts = [str(p) for p in loc if p != "body" and (isinstance(p, int) or _is_field(p))]
    return ".".join(parts) or None


def _is_field(part) -> bool:
    return str(part).isidentifier() and str(part) not in ("str", "int", "float", "bool", "list", "dict")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(req: Request, exc: OpenAIError):
        return exc.response(req.scope.get("path", ""))

    @app.exception_handler(RequestValidationError)
    async def _validation(req: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _validation_param(first.get("loc", ()))
        msg = first.get("msg", "invalid request")
        text = f"{param}: {msg}" if param else msg
        if first.get("type") == "json_invalid":
            text, param = f"The request body is not valid JSON: {msg}", None
        elif param is None:
            text = f"The request body must be a JSON object: {msg}"
        return invalid(text, param).response(req.scope.get("path", ""))

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return OpenAIError(exc.status_code, str(exc.detail), kind, None, None,
                           dict(exc.headers or {})).response(req.scope.get("path", ""))

    @app.exception_handler(Exception)
    async def _internal(req: Request, exc: Exception):
        log.exception("unhandled error on %s", req.scope.get("path", ""))
        path = req.scope.get("path", "")
        named = "" if is_anthropic(path) else f": {type(exc).__name__}"     # Anthropic's names no type
        return OpenAIError(500, f"internal error{named}", "server_error", None,
                           "internal_error").response(path)
