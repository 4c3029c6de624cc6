"""Loaded by every Python process started with ``<tree>/bench/attach`` on PYTHONPATH (site's hook),
the serving stack's stubs included: the lab's reach into processes it does not start itself.

- The checkout on PYTHONPATH wins over the venv's editable install (whose import finder would
  otherwise serve the checkout the venv was installed from): ``load.overhead_ab NAME@tree=DIR``
  serves DIR's code.
- The lab's tracers attach to the product's hook (backend/timing.py) when their environment asks.
"""
import os
import pathlib
import sys

_tree = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
sys.path[:] = _tree + [p for p in sys.path if p not in _tree]
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable___triton_llm")]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))   # this checkout, for `bench`

from bench import ttft_trace  # noqa: E402

ttft_trace.attach_from_env()
