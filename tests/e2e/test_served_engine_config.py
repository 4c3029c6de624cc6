"""The config tritonserver loaded for the engine model lists every engine option (generated from
backend/config.py by backend/serving/engine_parameters.py): the session's options at their values,
the rest at their defaults."""
from __future__ import annotations

import json
import urllib.request

import pytest

from backend.config import option_names
from backend.serving.engine_parameters import engine_parameters
from backend.serving.repository import declared_parameters
from tests.conftest import E2E_ENGINE_OPTIONS

pytestmark = pytest.mark.e2e


def test_the_served_engine_config_lists_every_option(triton_server):
    with urllib.request.urlopen(f"http://{triton_server.http_url}/v2/models/engine/config", timeout=30) as r:
        served = {k: v["string_value"] for k, v in json.load(r)["parameters"].items()}
    want = declared_parameters(engine_parameters(E2E_ENGINE_OPTIONS))
    want["drain_file"] = str(triton_server.drain_file)      # the launcher's own drain deadline file
    assert {k: served.get(k) for k in option_names()} == want
