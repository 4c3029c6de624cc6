"""``TritonReplica``: one Ray Serve replica = one tritonserver on our model repository.

The constructor starts the server with our launcher (backend/serving/launcher.py TritonServer);
``check_health`` (called by Ray every ``health_check_period_s``) fails when the server exited, is
not ready or its engine reports ``llm_engine_healthy`` 0, and Ray then replaces the replica;
``__del__`` stops the server (Ray calls it on scale-in and shutdown, after in-flight requests
finished within ``graceful_shutdown_timeout_s``).

``generate`` forwards one request over a tritonclient gRPC stream (client/triton_client.py) and
yields each chunk as a dict. Errors are yielded as a record ``{"error": {...}}`` (kind, message,
param, retry_after) rather than raised, so the typed error survives the hop without pickling
exceptions; a cancelled ``generate`` (the caller went away) unwinds the gRPC client, which sends
the engine's explicit abort and drains the half-closed stream (it never cancels the RPC).
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile

from backend.disagg.secret import write_secret
from triton_llm.scale.loopback import bind_replica_grpc_to_loopback
from backend.serving.launcher import TritonServer
from client.errors import TritonLLMError, UnavailableError

bind_replica_grpc_to_loopback()                     # in the replica process, before Serve binds it


def error_record(exc: TritonLLMError, replica: str, dead: bool = False) -> dict:
    return {"error": {"kind": exc.kind, "message": exc.message, "param": getattr(exc, "param", None),
                      "retry_after": getattr(exc, "retry_after", None)},
            "replica": replica, "replica_dead": dead}


class TritonReplica:
    def __init__(self, model_dir: str, engine_options: dict | None = None, model_label: str = "primary",
                 startup_timeout: float = 300.0) -> None:
        self.model_label = model_label
        self.replica = _replica_id()
        # The workdir names the replica, so an operator (and the e2e test) can tell whose server is whose.
        self.workdir = tempfile.mkdtemp(prefix=f"tllm-replica-{self.replica}-")
        engine_options = dict(engine_options or {})
        if engine_options.get("role") == "prefill" and engine_options.get("kv_connector") == "tcp":
            # decode replicas on other nodes fetch the staged KV from this address
            engine_options.setdefault("kv_connector_host", _node_ip())
        if engine_options.get("kv_secret"):             # the app's KV secret: to a 0600 file, never argv
            engine_options["kv_secret_file"] = write_secret(os.path.join(self.workdir, "kv.secret"),
                                                            engine_options.pop("kv_secret"))
        self.server = TritonServer(model_dir, engine_options=engine_options, quiet=True,
                                   startup_timeout=startup_timeout, exit_timeout=5, workdir=self.workdir)
        self.server.start()
        self._client = None

    def _grpc(self):
        if self._client is None:                    # made inside the replica's event loop
            from client.triton_client import TritonLLMClient
            self._client = TritonLLMClient(self.server.grpc_url)
        return self._client

    async def generate(self, request: dict):
        agen = self._grpc().generate(prompt=request.get("prompt"), messages=request.get("messages"),
                                     request_id=request.get("request_id"), params=request.get("params"),
                                     stream=bool(request.get("stream", True)))
        try:
            async for chunk in agen:
                item = dataclasses.asdict(chunk)
                item["replica"], item["model_label"] = self.replica, self.model_label
                yield item
        except TritonLLMError as exc:
            yield error_record(exc, self.replica, dead=await self._died(exc))
        finally:
            await agen.aclose()

    async def _died(self, exc: TritonLLMError) -> bool:
        """Whether the server is gone. A connection refused can arrive a moment before the killed
        process is reaped, so an "unavailable" error waits up to a second for it."""
        for _ in range(10 if exc.kind == "unavailable" else 1):
            if not self.server.alive():
                return True
            await asyncio.sleep(0.1)
        return False

    async def info(self) -> dict:
        """Who this replica is and where its server listens (tests, the stats route)."""
        return {"replica": self.replica, "model_label": self.model_label, "pid": self.server.proc.pid
                if self.server.proc else None, "grpc": self.server.grpc_url, "metrics": self.server.metrics_url,
                "host_pid": os.getpid()}

    async def is_ready(self) -> bool:
        return await self._grpc().is_ready()

    async def context_window(self) -> int:
        return await self._grpc().context_window()

    async def check_health(self) -> None:
        if not self.server.alive():
            raise RuntimeError(f"tritonserver of {self.replica} exited")
        url = f"http://{self.server.http_url}/v2/health/ready"
        if not await asyncio.to_thread(TritonServer.is_ready, url):
            raise RuntimeError(f"tritonserver of {self.replica} is not ready")
        if await asyncio.to_thread(self.server.engine_healthy) is False:
            raise RuntimeError(f"the engine of {self.replica} reports llm_engine_healthy 0")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(grace=10)
            shutil.rmtree(self.workdir, ignore_errors=True)


def _node_ip() -> str:
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:                               # noqa: BLE001 -- outside Ray (tests)
        return "127.0.0.1"


def _replica_id() -> str:
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:                               # noqa: BLE001 -- outside Ray (tests)
        return f"local-{os.getpid()}"


__all__ = ["TritonReplica", "error_record", "UnavailableError"]
