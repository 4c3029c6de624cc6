"""The real-server fixture: one tritonserver per test session, shared by every e2e test.

    def test_something(triton_server):                 # a started backend.serving.TritonServer
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)

It serves the whole model repository (preprocessing, engine, postprocessing, llm) for the ``tiny``
checkpoint, with loopback ports picked at random. ``triton_server.metrics_url``, ``.http_url`` and
``.model_dir`` are there too. Tests that need different engine options start their own
``TritonServer`` (a context manager) rather than changing this one.
"""
from __future__ import annotations

import pytest

from backend.serving.install import find_tritonserver
from backend.serving.launcher import TritonServer
from tests.conftest import model_dir

# Small and fast on 2 CPU cores; still enough KV blocks for 16 concurrent streams.
E2E_ENGINE_OPTIONS = {"num_kv_blocks": "256", "block_size": "16", "max_num_seqs": "32",
                      "max_num_batched_tokens": "512", "num_threads": "1"}


def _tritonserver_available() -> bool:
    try:
        find_tritonserver()
        return True
    except FileNotFoundError:
        return False


def pytest_collection_modifyitems(config, items):
    if _tritonserver_available():
        return
    skip = pytest.mark.skip(reason="tritonserver not installed (pip install nvidia-pytriton)")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def triton_server():
    with TritonServer(model_dir("tiny"), engine_options=E2E_ENGINE_OPTIONS, quiet=True) as server:
        yield server
