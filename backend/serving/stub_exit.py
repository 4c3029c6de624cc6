"""Python-backend stubs exit as soon as their model is finalized.

Triton stops a stub by sending it a finalize message, and the stub answers *before* it calls the
model's ``finalize()``; the server then only waits for the process to exit, one model instance
after another. What the stub does after ``finalize()`` -- joining its monitor threads, then the
embedded interpreter's teardown of every module (torch, transformers) -- took about 1.2 s per
instance here, so an idle ``triton-llm serve`` needed 5-8 s to stop (issue 19 wants < 5 s).
Nothing after ``finalize()`` is needed: the answer is sent, the parent owns and removes the
shared-memory regions, and the kernel unmaps them. So ``finalize()`` ends with :func:`exit_stub`.
"""
from __future__ import annotations

import os
import sys


def in_stub() -> bool:
    """True inside a Python-backend stub process (not in tests that drive model.py with a fake)."""
    try:
        return os.path.basename(os.readlink("/proc/self/exe")) == "triton_python_backend_stub"
    except OSError:
        return False


def exit_stub() -> None:
    """Flush and leave the stub process at once (call last in a model's ``finalize``)."""
    if not in_stub():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:                   # noqa: BLE001 - a closed pipe: nothing to flush
            pass
    os._exit(0)
