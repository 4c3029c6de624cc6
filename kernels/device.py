"""Where the Triton kernels can run, and the launch sizes for the device at hand.

Nothing here touches CUDA at import time: the checks run when first asked.
Under ``TRITON_INTERPRET=1`` (set before ``kernels`` is imported) the kernels run on CPU
through Triton's interpreter; there every program costs ~0.5 ms of Python, so the
interpreter gets few, large blocks, while a GPU gets the sizes its tensor cores like.
"""
from __future__ import annotations

import functools

from common import env

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except Exception:  # pragma: no cover - e.g. a Python without triton
    HAVE_TRITON = False

# triton.jit picks the interpreter when the kernels are defined, i.e. when kernels/ is imported.
INTERPRET = env.flag("TRITON_INTERPRET")


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def interpreted() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (run on CPU tensors)."""
    return HAVE_TRITON and INTERPRET


def triton_available(device: str | None = None) -> bool:
    """Whether the Triton kernels can run for tensors on ``device`` (default: anywhere here).

    On CUDA tensors: triton installed, CUDA present, not in interpreter mode.
    On CPU tensors: only in interpreter mode.
    """
    if not HAVE_TRITON:
        return False
    kind = None if device is None else str(device).split(":")[0]
    if INTERPRET:
        return kind in (None, "cpu")
    return kind in (None, "cuda") and _cuda_available()


def check_device(t) -> None:
    """Reject tensors the compiled/interpreted kernels cannot address, with a clear message."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed; use kernels.reference instead")
    if INTERPRET and t.device.type != "cpu":
        raise RuntimeError("kernels were defined under TRITON_INTERPRET=1: pass CPU tensors")
    if not INTERPRET and t.device.type != "cuda":
        raise RuntimeError(f"Triton kernels need CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 "
                           "before importing kernels to run them on CPU, or use kernels.reference")


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int = 0) -> int:
    if INTERPRET:
        return 1
    import torch
    return torch.cuda.get_device_properties(device_index).multi_processor_count
