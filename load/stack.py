"""Model resolution and the full serving stack for benchmarks: tritonserver (the project's launcher)
plus the OpenAI shim, on free loopback ports.

    with Stack(resolve_model("bench-15m"), {"max_num_seqs": 64}) as stack:
        stack.shim_url, stack.grpc_url, stack.metrics_url

``wait_engine_idle`` waits for an empty engine after a run; ``stop_timed`` stops the server and
says whether its exit timeout expired (load/soak.py, load/hangups.py).
"""
from __future__ import annotations

import pathlib
import signal
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
# Benchmark engine options per preset: KV pools large enough that 64 streams of the documented
# workloads never preempt; everything else is EngineArgs' default.
MODEL_OPTIONS = {"bench-15m": {"kv_cache_memory": 512 * MiB, "max_num_seqs": 64},
                 "bench-110m": {"kv_cache_memory": 2048 * MiB, "max_num_seqs": 64}}


def engine_options(model: str, extra: list[str] | None = None) -> dict:
    """The preset's benchmark options, overridden by KEY=VALUE items. A checkpoint that is not a
    preset (the default model) gets the KV budget ``triton-llm serve`` gives it, so a run measures
    what a user of ``serve`` gets (EngineArgs' own 256 MiB had evicted the prompts that a peers
    run replays)."""
    from triton_llm.cli import SERVE_KV_CACHE_MEMORY
    from backend.make_model import PRESETS

    given, name = parse_options(extra), pathlib.Path(model).name
    base = MODEL_OPTIONS.get(name, {})
    if name not in PRESETS and not {"kv_cache_memory", "num_kv_blocks"} & set(given):
        base = {"kv_cache_memory": SERVE_KV_CACHE_MEMORY}
    return {**base, **given}


def resolve_model(name_or_dir: str) -> pathlib.Path:
    """A checkpoint directory, or a preset made once under build/models (as the tests do)."""
    path = pathlib.Path(name_or_dir)
    if (path / "config.json").exists():
        return path
    from backend.make_model import PRESETS

    if name_or_dir not in PRESETS:
        raise ValueError(f"{name_or_dir!r} is neither a checkpoint directory nor a preset "
                         f"({', '.join(sorted(PRESETS))})")
    from tests.conftest import model_dir

    return model_dir(name_or_dir)


def parse_options(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"engine option {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def wait_engine_idle(metrics_url: str, timeout: float = 30.0) -> tuple[bool, dict[str, float]]:
    """Poll the server's metrics until no request runs or waits and the KV pool is empty:
    (idle, the last metrics read)."""
    from load.counters import parse_prometheus, scrape_text

    deadline = time.monotonic() + timeout
    while True:
        m = parse_prometheus(scrape_text(metrics_url))
        idle = all(m.get(k, 1) == 0 for k in ("llm_kv_cache_usage_ratio", "llm_num_requests_running",
                                                 "llm_num_requests_waiting"))
        if idle or time.monotonic() > deadline:
            return idle, m
        time.sleep(0.5)


def stop_timed(server) -> tuple[float, bool]:
    """SIGTERM a started TritonServer and wait for it: (seconds it took, whether its exit timeout
    expired -- something still held a model, e.g. a request state Triton 2.51 leaked when an RPC
    was cancelled as its last write completed, which keeps ``llm`` loaded; docs/serving.md)."""
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=server.exit_timeout + 30)
    return time.monotonic() - t0, "Exit timeout expired" in server.log_path.read_text(errors="replace")


class Stack:
    """tritonserver + shim; ``shim=False`` for Triton only; ``server_options``: more TritonServer
    arguments (``log_verbose``, ...)."""

    def __init__(self, model_dir: pathlib.Path, engine_options: dict | None = None, *,
                 shim: bool = True, quiet: bool = True, **server_options) -> None:
        from backend.serving.launcher import TritonServer

        self.server = TritonServer(model_dir, engine_options={k: str(v) for k, v in (engine_options or {}).items()},
                                   quiet=quiet, **server_options)
        self.want_shim = shim
        self.shim_proc = None
        self.shim_port = None

    def __enter__(self) -> "Stack":
        from backend.serving.launcher import free_port, start_shim

        self.server.start()
        try:
            if self.want_shim:
                self.shim_port = free_port()
                args = types.SimpleNamespace(shim_port=self.shim_port, host="127.0.0.1", api_keys=None)
                self.shim_proc = start_shim(args, self.server, self.server.workdir)
                if self.shim_proc is None:
                    raise RuntimeError("client/shim is not available")
        except BaseException:
            self.server.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        from backend.serving.launcher import terminate_group

        if self.shim_proc is not None:
            terminate_group(self.shim_proc, timeout=5)
        self.server.stop()

    @property
    def shim_url(self) -> str:
        return f"http://127.0.0.1:{self.shim_port}/v1"

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url
