"""Loaded by every Python process started with ``PYTHONPATH=bench/attach`` (site's hook): attaches
the lab's tracers to the product's hook (backend/timing.py) when their environment asks for it."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))   # the checkout, for `bench`

from bench import ttft_trace  # noqa: E402

ttft_trace.attach_from_env()
