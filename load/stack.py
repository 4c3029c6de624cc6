"""Model resolution and the full serving stack for benchmarks: tritonserver (the project's launcher)
plus the OpenAI shim, on free loopback ports.

    with Stack(resolve_model("bench-15m"), {"max_num_seqs": 64}) as stack:
        stack.shim_url, stack.grpc_url, stack.metrics_url
"""
from __future__ import annotations

import pathlib
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
    from backend.cli import SERVE_KV_CACHE_MEMORY
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


class Stack:
    """tritonserver + shim; ``shim=False`` for Triton only."""

    def __init__(self, model_dir: pathlib.Path, engine_options: dict | None = None, *,
                 shim: bool = True, quiet: bool = True) -> None:
        from backend.serving.launcher import TritonServer

        self.server = TritonServer(model_dir, engine_options={k: str(v) for k, v in (engine_options or {}).items()},
                                   quiet=quiet)
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
