"""Load / unload a LoRA adapter on a running server: one ``lora_admin`` control request to the
engine model (backend/serving/lora_control.py), answered once; errors come back typed."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from backend import protocol as P
from client.errors import TritonLLMError, error_from_grpc, error_from_message


async def lora_admin(client: Any, action: str, name: str, path: str | None = None, timeout: float = 60.0) -> None:
    """``client``: a TritonLLMClient. Raises TritonLLMError (InvalidRequestError naming
    ``lora_name`` / ``lora_path`` for an unknown or bad adapter)."""
    command = {"action": action, "lora_name": name, **({"lora_path": path} if path is not None else {})}

    async def requests():
        yield {"model_name": client.engine, "inputs": [], "request_id": f"lora-{uuid.uuid4().hex}",
               "parameters": {P.LORA_ADMIN: json.dumps(command)}}

    call = client._client().stream_infer(requests())

    async def answer() -> None:
        async for _result, error in call:
            if error is not None:
                raise error_from_message(error.message() if hasattr(error, "message") else str(error))
            return

    try:
        await asyncio.wait_for(answer(), timeout)
    except TritonLLMError:
        raise
    except Exception as exc:                    # noqa: BLE001 - the stream failed: typed
        raise error_from_grpc(exc) from None
    finally:
        call.cancel()
