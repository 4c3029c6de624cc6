"""The request-parameter codec (common/param_codec.py): what a client writes the server reads
back as the same values, each bad value names its parameter, and a request that asks for no
structured output never enters backend/structured."""
from __future__ import annotations

import numpy as np
import pytest

from backend.errors import EngineError
from backend.serving.intake import request_settings
from common import param_codec as codec


def test_what_the_client_writes_the_server_reads():
    sent = {"n": np.int64(2), "max_tokens": 7, "temperature": 0.5, "stop": ["\n", "END"], "stop_token_ids": [2],
            "stream": False, "ignore_eos": True, "priority": 3, "timeout": 1.5, "tenant": "acme",
            "logprobs": True, "top_logprobs": 2, "seed": 2 ** 63 - 1, "user": None}
    wire = codec.encode(sent)
    assert all(isinstance(v, (str, bool, int, float)) for v in wire.values())
    assert "user" not in wire and wire["request_priority"] == 3 and wire["request_timeout"] == 1.5
    assert [type(v) for v in codec.encode({"a": np.float64(0.5), "b": np.bool_(True)}).values()] == [float, bool]
    rp = codec.decode(wire)
    assert rp.sampling == {"n": 2, "max_tokens": 7, "temperature": 0.5, "stop": ["\n", "END"],
                           "stop_token_ids": [2], "ignore_eos": True, "seed": 2 ** 63 - 1}
    assert (rp.stream, rp.priority, rp.timeout, rp.tenant, rp.logprobs) == (False, 3, 1.5, "acme", 2)
    assert rp.max_tokens_given and rp.structured == {}


@pytest.mark.parametrize("params, param", [
    ({"max_tokens": "ten"}, "max_tokens"), ({"temperature": "hot"}, "temperature"), ({"stream": "perhaps"}, "stream"),
    ({"stop_token_ids": "[-1]"}, "stop_token_ids"), ({"request_priority": 10 ** 12}, "request_priority"),
    ({"request_timeout": 0}, "request_timeout"), ({"tenant": "x" * 400}, "tenant"), ({"seed": str(2 ** 63)}, "seed"),
    ({"embed": True, "dimensions": "wide"}, "dimensions"),
])
def test_a_bad_value_names_its_parameter(params, param):
    with pytest.raises(codec.ParamError) as info:
        codec.decode(params)
    assert info.value.param == param and str(info.value).startswith(param)
    with pytest.raises(EngineError) as served:            # the server's answer: the same name
        request_settings(params)
    assert served.value.param == param


def test_the_client_refuses_what_the_wire_cannot_carry():
    with pytest.raises(codec.ParamError) as info:
        codec.encode({"max_tokens": 2 ** 63})
    assert info.value.param == "max_tokens"
    with pytest.raises(ValueError, match="reserved"):
        codec.encode({"sequence_id": 1})


def test_booleans_use_the_one_dialect():
    assert [codec.decode({"stream": v}).stream for v in ("on", "no", "1", "TRUE", 0)] == [True, False, True, True, False]


def test_structured_work_only_for_requests_that_ask():
    plain = request_settings({"temperature": 0, "tool_choice_extra": "x"})
    assert not plain.sampling.constrained and plain.sampling.structured is None
    asked = request_settings({"guided_regex": "[ab]+", "logit_bias": '{"3": 5}'})
    assert asked.sampling.constrained and asked.sampling.structured.kind == "regex"
    assert asked.sampling.logit_bias == {3: 5.0}
    with pytest.raises(EngineError) as info:
        request_settings({"guided_regex": "a", "guided_choice": '["x"]'})
    assert info.value.param == "guided_choice"


def test_preprocessing_reads_only_its_prompts_parameters():
    from backend.serving.preprocess import Preprocessor
    from tests.conftest import model_dir

    pre = Preprocessor(model_dir("tiny"), context_window=64)
    bad_for_the_engine = {"temperature": "nan", "n": 99, "max_tokens": 10 ** 9, "stream": "perhaps"}
    assert pre("hello", None, bad_for_the_engine) == pre.encode_prompt("hello")
    with pytest.raises(EngineError) as info:            # its own parameter is still checked
        pre("hello", None, {"embed": "perhaps"})
    assert info.value.param == "embed"
    text = " ".join(["word"] * 200)
    n = len(pre.encode_prompt(text))
    window = Preprocessor(model_dir("tiny"), context_window=n)     # the prompt fills it exactly
    with pytest.raises(EngineError, match="at least one must be left"):
        window(text, None, {})
    assert len(window(text, None, {"embed": True})) == n  # an embedding may fill the window
