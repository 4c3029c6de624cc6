"""Clients of the Triton LLM server: gRPC streaming client, terminal chat, OpenAI-compatible shim."""
from client.errors import (AbortedError, InternalError, InvalidRequestError, QueueFullError,
                           TritonLLMError, UnavailableError)
from client.triton_client import TritonLLMClient
from client.wire import Chunk

__all__ = ["Chunk", "TritonLLMClient", "TritonLLMError", "InvalidRequestError", "QueueFullError",
           "UnavailableError", "InternalError", "AbortedError"]
