"""What the served weights are (dtype, quantization, weight bytes), reported without loading them:
planned_summary() on the meta device equals the loaded model's summary(); generate_repository()
writes it into the engine's config under backend/protocol.py's names; the shim's model card shows
what the client read. The real stack (tritonserver + shim + openai SDK) is tests/e2e/test_quant_serving.py.
"""
from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from backend import protocol as P
from backend.config import EngineArgs, option_names
from backend.model.config import load_model_config
from backend.model.loader import auto_dtype, load_model, parse_dtype
from backend.quant.plan import planned_summary
from backend.serving.repository import TEMPLATES, declared_parameters, generate_repository, parse_engine_options
from client.fake_client import FakeLLMClient
from client.shim import ShimSettings, create_app
from tests.conftest import model_dir


@pytest.mark.parametrize("method", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_planned_summary_is_the_loaded_models(method, dtype):
    d = model_dir("tiny")
    loaded = load_model(d, load_model_config(d), dtype=dtype, quantization=method).quantization
    assert planned_summary(d, dtype=dtype, quantization=method) == loaded
    assert loaded["method"] == method


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_lm_head_is_a_copy_and_stays_close(method):
    """quant_lm_head: tiny's tied head gets a QuantLinear copy (the embedding table stays fp32 for
    the lookup); the logits stay near the float-head model's; planned bytes = loaded bytes."""
    d = model_dir("tiny")
    cfg = load_model_config(d)
    plain = load_model(d, cfg, dtype=torch.float32, quantization=method)
    head = load_model(d, cfg, dtype=torch.float32, quantization=method, quant_lm_head=True)
    assert plain.lm_head_q is None and head.lm_head_q.method == method
    assert head.model.embed_tokens.dtype == torch.float32
    assert head.quantization == planned_summary(d, dtype=torch.float32, quantization=method, lm_head=True)
    assert head.quantization["lm_head"] and not plain.quantization["lm_head"]
    h = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))   # not the global RNG: same in any test order
    ref = torch.nn.functional.linear(h, plain.lm_head_weight())
    got = head.lm_head_q(h)
    assert (got - ref).abs().max() <= (0.02 if method == "int8" else 0.2) * ref.abs().max()
    with pytest.raises(ValueError, match="quant_lm_head needs"):
        load_model(d, cfg, dtype=torch.float32, quant_lm_head=True)


def test_planned_summary_refuses_what_the_loader_refuses():
    with pytest.raises(ValueError, match="quantization must be"):
        planned_summary(model_dir("tiny"), dtype=torch.float32, quantization="int3")
    with pytest.raises(ValueError, match="multiple of 32"):
        planned_summary(model_dir("tiny"), dtype=torch.float32, quantization="int4", group_size=48)


def test_engine_config_declares_the_weights_parameters_and_they_are_not_options():
    cfg = text_format.Parse((TEMPLATES / P.ENGINE / "config.pbtxt").read_text(), mc.ModelConfig())
    for key in P.WEIGHTS_PARAMS:
        assert key in cfg.parameters and cfg.parameters[key].string_value == "", key
    assert not set(P.WEIGHTS_PARAMS) & set(option_names())
    with pytest.raises(ValueError, match="unknown engine option"):
        parse_engine_options(["weight_bytes=1"])


@pytest.mark.parametrize("opts,want", [
    ({"quantization": "int8"}, ("float32", "int8", "32")),                  # groups of 32: the default
    ({"quantization": "int8", "quant_group_size": "0"}, ("float32", "int8", "")),   # per channel: G = K varies
    ({"quantization": "int4", "quant_group_size": "64", "dtype": "bfloat16"}, ("bfloat16", "int4", "64")),
    ({"dtype": "auto"}, ("float32", "none", "")),          # auto resolved (fp32 on this AVX2 CPU)
])
def test_generate_repository_writes_what_the_engine_will_load(tmp_path, opts, want):
    if opts.get("dtype") == "auto":
        want = (auto_dtype("cpu"),) + want[1:]
    repo = generate_repository(tmp_path / "repo", model_dir("tiny"), engine_options=opts)
    params = declared_parameters((repo / P.ENGINE / "config.pbtxt").read_text())
    got = tuple(params[k] for k in (P.WEIGHTS_DTYPE, P.WEIGHTS_QUANTIZATION, P.WEIGHTS_GROUP_SIZE))
    assert got == want
    args = EngineArgs.from_dict(opts).engine
    d = model_dir("tiny")
    loaded = load_model(d, load_model_config(d), dtype=parse_dtype(args.dtype, "cpu"), quantization=args.quantization,
                        quant_group_size=args.quant_group_size, quant_lm_head=args.head_quantized).quantization
    assert int(params[P.WEIGHT_BYTES]) == loaded["weight_bytes"]


class _Reporting(FakeLLMClient):
    def __init__(self, info: dict | None) -> None:
        super().__init__()
        self.info, self.asked = info, 0

    async def weights_info(self) -> dict:
        from client.errors import UnavailableError
        self.asked += 1
        if self.info is None:
            raise UnavailableError("not up yet")
        return self.info


def test_model_card_shows_the_weights_and_asks_once():
    info = {"dtype": "float32", "quantization": "int8", "quant_group_size": None, "weight_bytes": 6133504}
    client = _Reporting(None)
    with TestClient(create_app(ShimSettings(model_name="tiny"), client=client)) as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["id"] == "tiny" and "weight_bytes" not in card          # server cannot say yet
        client.info = info
        for _ in range(2):
            card = http.get("/v1/models/tiny").json()
            assert {k: card[k] for k in info} == info
    assert client.asked == 2                                                 # cached once known


def test_model_card_of_a_client_that_cannot_ask():
    with TestClient(create_app(ShimSettings(model_name="tiny"), client=FakeLLMClient())) as http:
        card = http.get("/v1/models/tiny").json()
        assert card["id"] == "tiny" and "quantization" not in card
