"""The ``lora`` request parameter reaches SamplingParams (backend/serving/intake.py)."""
from __future__ import annotations

import pytest

from backend import SamplingParams
from backend.errors import EngineError
from backend.serving.intake import request_settings


def test_lora_parameter():
    assert request_settings({"lora": "ada8"}).sampling.lora == "ada8"
    assert request_settings({}).sampling.lora is None
    assert request_settings({"lora": ""}).sampling.lora is None      # empty = the base model
    with pytest.raises(EngineError) as err:
        request_settings({"lora": "x" * 129})
    assert err.value.param == "lora"


def test_sampling_params_lora_validated():
    with pytest.raises(ValueError, match="lora must be an adapter name"):
        SamplingParams(lora=3)
