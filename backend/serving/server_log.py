"""What a tritonserver log says about a failed start: its error lines and its last lines."""
from __future__ import annotations

import pathlib
import re

# Errors tritonserver logs on every CPU-only start; they say nothing about why a start failed.
_HARMLESS = ("CudaDriverHelper has not been initialized", "Unable to allocate pinned system memory",
             "CUDA driver version is insufficient")


def log_tail(path: pathlib.Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def log_errors(path: pathlib.Path, limit: int = 20) -> list[str]:
    """The lines of a tritonserver log that say what went wrong (load failures, parse errors)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        if any(h in line for h in _HARMLESS):
            continue
        if re.match(r"^E\d{4} ", line) or "ERROR" in line or line.startswith("error:") or "UNAVAILABLE:" in line:
            found.append(line.strip()[:2000])
    return found[-limit:]


def failure_report(path: pathlib.Path) -> str:
    errors = log_errors(path)
    reason = "\n".join(errors) if errors else "(no error lines logged)"
    return f"errors logged:\n{reason}\nlast lines of {path}:\n{log_tail(path, 15)}"
