"""Every environment variable the product reads, in one table, and the one place that reads them.

Options belong in engine options, the shim's flags or the CLI (backend/config.py, docs/reference.md);
the environment carries only what must reach processes the product does not start with arguments
(the Triton stubs, Ray's workers, a compose service) and switches for diagnosis. An unregistered
name is a KeyError here, so a new variable cannot hide in some module. The C kernels read none:
what they need comes in as arguments.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")


def parse_bool(text: str, *, name: str = "value") -> bool:
    """The one boolean dialect (engine options, flags, the environment)."""
    v = text.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise ValueError(f"{name} must be one of {', '.join(TRUE + FALSE)} (got {text!r})")


@dataclass(frozen=True, slots=True)
class Var:
    name: str
    default: str | None         # None: unset unless the environment says
    doc: str


VARS: dict[str, Var] = {v.name: v for v in [
    # the fused CPU step and the C kernels (backend/model/fused_decode.py, kernels/cpu.py)
    Var("TRITON_LLM_FUSED_DECODE", "1", "0: every step runs the torch path instead of the fused C step"),
    Var("TRITON_LLM_FUSED_MAX_TOKENS", None, "steps with more new tokens than this run the torch path"),
    Var("TRITON_LLM_FUSED_GEMM_MIN_M", None, "fused-step fp32 linears with at least this many rows call MKL's sgemm"),
    Var("TRITON_LLM_AMX", "1", "0: bf16 linears never use AMX tiles"),
    Var("TRITON_LLM_HUGE_PAGES", "1", "0: weights stay in torch's allocations (no MADV_HUGEPAGE arena)"),
    Var("TRITON_LLM_CPU_KERNELS", "1", "0: never build or load the C kernels (torch paths only)"),
    Var("TRITON_LLM_KERNEL_CACHE", None, "folder of the compiled C kernels (private, 0700; default build/kernels)"),
    Var("CC", "cc", "the C compiler for the kernels"),
    Var("TRITON_INTERPRET", "0", "1: OpenAI-Triton kernels run in its interpreter (CPU); read by triton too"),
    # serving (backend/serving, backend/engine)
    Var("TRITON_LLM_ENGINE_NICE", None, "nice value of the engine thread (the engine stub's default is set by the launcher)"),
    Var("TRITON_LLM_DRAIN_SECONDS", "60", "serve's drain on SIGTERM: open streams may finish this long"),
    Var("TRITONSERVER", None, "the tritonserver binary to use instead of the pytriton wheel's"),
    Var("TRITON_LLM_TEST_FAULTS", "0", "1 (tests only): the engine honours the test_fault request parameter"),
    # the shim (client/shim/settings.py)
    Var("TRITON_LLM_API_KEYS", None, "comma-separated KEY[:TENANT] API keys, beside --api-keys FILE"),
    Var("TRITON_LLM_INSECURE_NO_API_KEYS", "0", "1: --insecure-no-api-keys (serve without keys beyond loopback)"),
    # scale-out (triton_llm/scale)
    Var("RAY_ADDRESS", None, "an existing Ray cluster to join (refused without token auth unless told)"),
    Var("RAY_AUTH_MODE", None, "Ray's; token: the cluster demands its auth token"),
    Var("RAY_AUTH_TOKEN", None, "Ray's auth token"),
    Var("RAY_AUTH_TOKEN_PATH", None, "a file holding Ray's auth token"),
    Var("RAY_gcs_server_port_wait_time_s", None, "Ray's; how long a starting head waits for its GCS "
        "(serve --replicas: 120 s unless set; Ray's own default is 30 s)"),
]}


def raw(name: str) -> str | None:
    """The variable's value, or its default; KeyError for a name not in VARS."""
    return os.environ.get(name, VARS[name].default)


def flag(name: str) -> bool:
    return parse_bool(raw(name) or "0", name=name)


def integer(name: str, default: int) -> int:
    v = raw(name)
    try:
        return default if v in (None, "") else int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer (got {v!r})") from None


def number(name: str) -> float:
    v = raw(name)
    try:
        return float(v)                 # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number (got {v!r})") from None


def snapshot() -> dict[str, str]:
    """A copy of the whole environment, for a child process's (tritonserver, the shim, Ray)."""
    return dict(os.environ)


def update(values: dict[str, str | None]) -> None:
    """Set (None: unset) variables of this process, which the processes it starts inherit."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
