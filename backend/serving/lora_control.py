"""LoRA admin control requests to the engine model (docs/lora.md): parameter ``lora_admin`` =
JSON ``{"action": "load", "lora_name": ..., "lora_path": ...}`` or ``{"action": "unload",
"lora_name": ...}`` and no inputs. The adapter's files are read on a short-lived thread, never on
Triton's execute thread or the engine thread; the request gets one answer: an empty FINAL on
success, or a tagged error (``[invalid_request param=...]``) naming what was wrong.

Requests already running on an unloaded adapter finish on it (they hold its weights).
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from typing import Any, Callable

from backend.errors import EngineError, invalid_request, unavailable
from backend.lora.adapter import LoRAError
from backend.lora.registry import LoRARegistry, UnknownAdapter
from backend.serving.intake import ControlAnswered, Rejected, RequestHandle


def registry_of(loop: Any) -> LoRARegistry | None:
    """The engine's adapter registry (None when LoRA is off or the loop has no local engine)."""
    return getattr(getattr(getattr(loop, "engine", None), "runner", None), "loras", None)


def warm(loop: Any, name: str) -> None:
    """Make a request's adapter resident before the request reaches the engine, so an evicted
    adapter is read from disk here (intake) rather than on the engine thread during a step.
    An unknown name is the request's 400 now. (Should it be evicted again before the engine
    resolves it, the engine reads it once more: correct, only slower.)"""
    registry = registry_of(loop)
    if registry is None:
        return                              # LoRA off: the engine gives the error
    try:
        registry.resolve(name)
    except UnknownAdapter:
        raise invalid_request("lora", f"unknown LoRA adapter {name!r}") from None
    except LoRAError as exc:
        raise unavailable(f"LoRA adapter {name!r}: {exc}") from None


def parse_command(raw: Any) -> tuple[str, str, str | None]:
    """(action, name, path) from the parameter's JSON; invalid_request naming the bad field."""
    try:
        cmd = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        raise invalid_request("lora_admin", "lora_admin must be a JSON object") from None
    if not isinstance(cmd, dict):
        raise invalid_request("lora_admin", "lora_admin must be a JSON object")
    action, name, path = cmd.get("action"), cmd.get("lora_name"), cmd.get("lora_path")
    if action not in ("load", "unload"):
        raise invalid_request("action", "action must be load or unload")
    if not isinstance(name, str) or not name:
        raise invalid_request("lora_name", "lora_name must be a non-empty string")
    if action == "load" and (not isinstance(path, str) or not path):
        raise invalid_request("lora_path", "lora_path must be a non-empty string")
    return action, name, path


def _apply(registry: LoRARegistry, action: str, name: str, path: str | None) -> None:
    try:
        if action == "load":
            registry.load(name, str(path))
        else:
            registry.unload(name)
    except UnknownAdapter:
        raise invalid_request("lora_name", f"unknown LoRA adapter {name!r}") from None
    except LoRAError as exc:
        raise invalid_request("lora_path" if action == "load" else "lora_name", str(exc)) from None
    except ValueError as exc:
        raise invalid_request("lora_name", str(exc)) from None


def handle(loop: Any, raw: Any, h: RequestHandle, post: Callable[[Any], None], now: float) -> None:
    """Validate now (errors raise EngineError to the caller), apply on a thread, answer once."""
    action, name, path = parse_command(raw)
    registry = registry_of(loop)
    if registry is None:
        raise invalid_request("lora_admin", "LoRA is off on this server (engine option max_loras)")

    def run() -> None:
        try:
            _apply(registry, action, name, path)
        except EngineError as err:
            post(Rejected(h, err))
            return
        done: Future = Future()
        done.set_result(None)               # nothing was aborted: the answer is an empty FINAL
        post(ControlAnswered(f"lora:{name}", h.responder, now, done))

    threading.Thread(target=run, name="lora-admin", daemon=True).start()
