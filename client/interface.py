"""The client interface the shim serves through, declared (``LLMClient``) instead of implied.

Four classes implement it, none by inheritance: ``client.triton_client.TritonLLMClient`` (one
tritonserver), ``client.disagg_client.DisaggLLMClient`` (a prefill/decode pair),
``triton_llm.scale.serve_client.ServeClient`` (Ray Serve replicas) and
``client.fake_client.FakeLLMClient`` (tests). tests/unit/test_client_interface.py checks each
against these Protocols member by member (names, sync/async, parameters).

``LLMClient`` is what every route needs. Embeddings and ``/health/weights`` are capabilities only
some clients have (the pair's client has no ``embed``): ``EmbeddingClient`` and
``WeightsInfoClient``, which the shim looks up before it calls them.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from client.wire import Chunk


@runtime_checkable
class LLMClient(Protocol):
    def generate(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None, *,
                 request_id: str | None = None, params: dict[str, Any] | None = None,
                 stream: bool = True) -> AsyncIterator[Chunk]:
        """Exactly one of ``prompt`` / ``messages``; the stream's chunks (errors raise
        client.errors.TritonLLMError subclasses)."""
        ...

    async def is_ready(self) -> bool:
        """Whether the server(s) behind the client answer as ready."""
        ...

    async def context_window(self) -> int:
        """The tokens one request may span (prompt + output), as the engine enforces it."""
        ...

    async def close(self) -> None:
        ...


@runtime_checkable
class EmbeddingClient(Protocol):
    async def embed(self, *, text: str | None = None, input_ids: list[int] | None = None,
                    params: dict[str, Any] | None = None,
                    request_id: str | None = None) -> tuple[list[float], int]:
        """One embedding: (vector, prompt tokens)."""
        ...


@runtime_checkable
class WeightsInfoClient(Protocol):
    async def weights_info(self) -> dict[str, Any]:
        """What the engine loaded (the ``/health/weights`` body)."""
        ...
