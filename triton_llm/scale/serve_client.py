"""``ServeClient``: the shim's client interface (``generate`` / ``is_ready`` / ``context_window``
/ ``close``, as client/triton_client.py TritonLLMClient) over Ray Serve deployment handles.

Per request: render + hash the prompt's leading blocks (prefix_key.py, off the event loop), decide
primary or fallback (fallback.py; opt-in per request by the ``x-allow-fallback`` header, served.py,
or per key by its tenant in ``fallback_tenants``), and stream from the replica Ray's router picks
(router.py) through ``handle.options(stream=True)``. Which deployment served is written into the
request's ``served.SERVED`` record, which names the model in the response.

Failover: a failure before the first chunk (the replica's tritonserver died, the replica actor
died) is retried on another replica, avoiding the failed one; after the first chunk it is raised as
UnavailableError, which the shim turns into an SSE error event (never a hang). Closing the stream
early cancels the Ray call; the replica's gRPC client then cancels and aborts in the engine.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import AsyncIterator

from backend import protocol as P
from triton_llm.scale.fallback import FallbackPolicy, QueueTimeTracker
from triton_llm.scale.metrics import RoutingMetrics
from triton_llm.scale.served import SERVED, truthy
from client.errors import (InternalError, InvalidRequestError, QueueFullError, TritonLLMError,
                           UnavailableError)
from client.wire import Chunk

log = logging.getLogger("triton_llm.scale")
FALLBACK_PARAM = "fallback"          # request parameter: true = may be served by the lighter model
ATTEMPTS = 3
_CHUNK_FIELDS = set(Chunk.__dataclass_fields__)


def rebuild_error(rec: dict) -> TritonLLMError:
    """The typed error a replica reported (kind-based: the wire tag was already parsed there)."""
    kind, msg = rec.get("kind"), rec.get("message") or ""
    if kind == "invalid_request":
        return InvalidRequestError(msg, param=rec.get("param"))
    if kind == "queue_full":
        return QueueFullError(msg, retry_after=rec.get("retry_after") or 1)
    if kind == "unavailable":
        return UnavailableError(msg)
    return InternalError(msg)


class ServeClient:
    def __init__(self, primary, *, keyer=None, fallback=None, fallback_policy: FallbackPolicy | None = None,
                 fallback_tenants: frozenset[str] | set[str] = frozenset(),
                 tenant_param: str = P.TENANT) -> None:
        self.primary = primary                       # DeploymentHandle to TritonReplica
        self.fallback = fallback                     # DeploymentHandle to the lighter model, or None
        self.keyer = keyer                           # PrefixKeyer, or None: no prefix routing keys
        self.fallback_policy = fallback_policy or FallbackPolicy()
        self.tenant_param = tenant_param
        self.fallback_tenants = frozenset(fallback_tenants)   # keys whose requests may degrade ("*": all)
        self.metrics = RoutingMetrics()              # fallbacks (routing decisions: router.py)
        self.ongoing = 0                             # primary requests open from this ingress
        self.served: dict[str, str] = {}             # last few request id -> replica (tests, stats)
        self.queue_time = QueueTimeTracker()         # the primary's recent engine queue time
        self.retries: Counter[str] = Counter()       # failover retries before the first chunk, by cause
        self._healthy, self._healthy_at = 1, float("-inf")   # running primary replicas, cached

    def generate(self, prompt: str | None = None, messages: list[dict] | None = None, *,
                 request_id: str | None = None, params: dict | None = None,
                 stream: bool = True) -> AsyncIterator[Chunk]:
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self._stream(prompt, messages, request_id, dict(params or {}), stream)

    async def _route(self, prompt, messages, params) -> list[str]:
        if self.keyer is None:
            return []
        return await asyncio.to_thread(self.keyer.chain, prompt=prompt, messages=messages,
                                       tenant=params.get(self.tenant_param), lora=params.get(P.LORA))

    def _opted_in(self, params: dict) -> bool:
        record = SERVED.get()
        return truthy(params.pop(FALLBACK_PARAM, "")) or bool(record and record["allow_fallback"]) or \
            "*" in self.fallback_tenants or params.get(self.tenant_param) in self.fallback_tenants

    async def _handle_for(self, params: dict):
        opted = self._opted_in(params)
        if self.fallback is None or not opted:
            return self.primary, None
        healthy = await self._healthy_primaries()
        reason = self.fallback_policy.use_fallback(opted_in=True, healthy_replicas=healthy,
                                                   ongoing=self.ongoing, fallback_available=True,
                                                   recent_queue_time_s=self.queue_time.current())
        if reason:
            self.metrics.fell_back(reason)
            return self.fallback, reason
        return self.primary, None

    async def _healthy_primaries(self, ttl_s: float = 1.0) -> int:
        """Running primary replicas (Serve's status, asked at most once per ``ttl_s`` and off the
        event loop: ``serve.status()`` is a blocking call to the controller)."""
        now = time.monotonic()
        if now - self._healthy_at > ttl_s:
            self._healthy_at = now
            self._healthy = await asyncio.to_thread(self._read_healthy)
        return self._healthy

    def _read_healthy(self) -> int:
        try:
            from ray import serve
            status = serve.status()
            for app in status.applications.values():
                for name, dep in app.deployments.items():
                    if name == self.primary.deployment_name:
                        return int(dep.replica_states.get("RUNNING", 0))
        except Exception:                            # noqa: BLE001 -- unknown: assume one
            pass
        return 1

    async def _stream(self, prompt, messages, request_id, params, stream) -> AsyncIterator[Chunk]:
        handle, reason = await self._handle_for(params)
        request = {"prompt": prompt, "messages": messages, "request_id": request_id, "params": params,
                   "stream": stream, "route": await self._route(prompt, messages, params), "avoid": []}
        primary = handle is self.primary
        record = SERVED.get()
        if record is not None:
            record["label"], record["reason"] = ("primary", None) if primary else ("fallback", reason)
        self.ongoing += primary
        try:
            for attempt in range(ATTEMPTS):
                started = False
                gen = handle.options(stream=True).generate.remote(request)
                try:
                    async for item in gen:
                        if "error" in item:
                            err = rebuild_error(item["error"])
                            # Nothing reached the client yet, and the replica is dead or could
                            # not serve (its server went away, it is draining): another may.
                            retry = item.get("replica_dead") or item["error"].get("kind") == "unavailable"
                            if not started and retry and attempt + 1 < ATTEMPTS:
                                request["avoid"].append(item["replica"])
                                self.retries["replica_dead" if item.get("replica_dead") else "unavailable"] += 1
                                log.warning("%s: replica %s failed before answering (%s); retrying "
                                            "elsewhere", request_id, item["replica"], err)
                                break
                            raise err
                        started = True
                        self._remember(request_id, item.get("replica"))
                        if primary and item.get("metrics"):
                            self.queue_time.observe(float(item["metrics"].get("queue_time") or 0.0))
                        yield Chunk(**{k: v for k, v in item.items() if k in _CHUNK_FIELDS})
                    else:
                        return
                except TritonLLMError:
                    raise
                except asyncio.CancelledError:
                    raise
                except Exception as exc:             # noqa: BLE001 -- the replica actor died, Ray errors
                    if started or attempt + 1 == ATTEMPTS:
                        raise UnavailableError(f"the replica serving {request_id} failed: "
                                               f"{type(exc).__name__}") from None
                    self.retries["replica_error"] += 1
                    log.warning("%s: replica failed before answering (%s); retrying", request_id, exc)
                    await asyncio.sleep(0.2 * (attempt + 1))
                finally:
                    gen.cancel()                     # no-op once finished; else aborts on the replica
            raise UnavailableError(f"no replica could serve {request_id}")
        finally:
            self.ongoing -= primary

    def _remember(self, request_id, replica) -> None:
        if request_id and replica and request_id not in self.served:
            self.served[request_id] = replica
            while len(self.served) > 1000:
                self.served.pop(next(iter(self.served)))

    async def is_ready(self, timeout: float = 2.0) -> bool:
        try:
            return bool(await asyncio.wait_for(self.primary.is_ready.remote(), timeout))
        except Exception:                            # noqa: BLE001
            return False

    async def context_window(self, timeout: float = 5.0) -> int:
        try:
            return int(await asyncio.wait_for(self.primary.context_window.remote(), timeout))
        except TritonLLMError:
            raise
        except Exception as exc:                     # noqa: BLE001
            raise UnavailableError(f"no replica reported its context window: {exc}") from None

    async def abort(self, request_id: str, timeout: float = 10.0, *, tenant: str | None = None) -> bool:
        """No explicit abort across Ray: a stream is stopped by cancelling its Ray call (the
        replica's gRPC client then aborts in its engine). A prefill replica's KV staged for a
        request whose decode hop ended early is released by its TTL (``kv_staged_ttl_s``)."""
        return False

    async def wait_aborts(self, timeout: float = 10.0) -> None:
        return None

    async def close(self) -> None:
        return None
