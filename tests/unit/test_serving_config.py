"""Request parameters, the context window and model-repository generation (no server)."""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, fields

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from backend import protocol as P
from backend.config import PARTS, EngineArgs, EngineConfig, option_names
from backend.context import context_window_for
from backend.serving.engine_parameters import engine_parameters, part_heading
from backend.errors import EngineError, ErrorKind
from backend.serving.repository import (TEMPLATES, declared_parameters, generate_repository,
                                        parse_engine_options, set_instance_count, set_parameter)
from backend.serving.intake import fit_context, request_settings
from backend.serving.preprocess import parse_parameters
from tests.conftest import model_dir


def test_parameters_are_coerced_from_triton_types():
    s = request_settings(parse_parameters(
        '{"temperature": "0.5", "max_tokens": "7", "stop": "[\\"\\\\n\\", \\"END\\"]", "stop_token_ids": "[2]",'
        ' "stream": "false", "n": 2, "seed": 3, "top_k": -1, "logprobs": true, "top_logprobs": 3,'
        ' "request_priority": 2, "request_timeout": 1.5, "tenant": "acme", "unknown_field": 1}'))
    sp = s.sampling
    assert (sp.temperature, sp.max_tokens, sp.stop, sp.stop_token_ids, sp.n, sp.seed, sp.top_k, sp.logprobs) == \
        (0.5, 7, ["\n", "END"], [2], 2, 3, 0, 3)
    assert (s.stream, s.priority, s.timeout, s.tenant, s.max_tokens_given) == (False, 2, 1.5, "acme", True)
    assert request_settings({"stop": "###"}).sampling.stop == ["###"]
    assert request_settings({"max_completion_tokens": 9}).sampling.max_tokens == 9
    assert request_settings({}).stream is True and request_settings({}).sampling.logprobs is None


@pytest.mark.parametrize("params, param", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": "inf"}, "temperature"),
    ({"temperature": -1}, "temperature"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"), ({"n": 0}, "n"), ({"stream": "maybe"}, "stream"),
    ({"stop_token_ids": "[\"a\"]"}, "stop_token_ids"), ({"stop_token_ids": "{}"}, "stop_token_ids"),
    ({"top_p": 0}, "top_p"), ({"logprobs": 50}, "logprobs"), ({"request_timeout": 0}, "request_timeout"),
    ({"seed": True}, "seed"),
])
def test_bad_parameters_name_the_parameter(params, param):
    with pytest.raises(EngineError) as info:
        request_settings(params)
    assert (info.value.kind, info.value.param) == (ErrorKind.INVALID_REQUEST, param)
    assert str(info.value).startswith(param)            # the message names it too


def test_parameters_json_errors():
    with pytest.raises(EngineError) as info:
        parse_parameters("{nope")
    assert info.value.param == "parameters"
    assert parse_parameters("") == {} and parse_parameters(None) == {}


def _param_of(call) -> str:
    with pytest.raises(EngineError) as info:
        call()
    assert info.value.kind == ErrorKind.INVALID_REQUEST
    return info.value.param


def test_fit_context():
    s = request_settings({})
    fit_context(s, 60, 64, "text_input")                # a default max_tokens shrinks to fit
    assert s.sampling.max_tokens == 4
    assert _param_of(lambda: fit_context(request_settings({"max_tokens": 5}), 60, 64, "text_input")) == "max_tokens"
    with pytest.raises(EngineError, match=r"^the prompt has 64 tokens") as info:
        fit_context(request_settings({}), 64, 64, "text_input")
    assert info.value.param == "text_input"
    assert _param_of(lambda: fit_context(request_settings({"min_tokens": 9, "max_tokens": 4}), 3, 64,
                                         "text_input")) == "min_tokens"


def test_context_window_is_clamped_by_the_kv_pool(tiny_model):
    cfg_len = 1024                                      # the tiny preset's max_position_embeddings
    assert context_window_for(tiny_model, EngineConfig(num_kv_blocks=1000)) == cfg_len
    assert context_window_for(tiny_model, EngineConfig(num_kv_blocks=10, block_size=16)) == 160
    assert context_window_for(tiny_model, EngineConfig(num_kv_blocks=1000, max_model_len=300)) == 300
    with pytest.raises(ValueError, match="max_position_embeddings"):
        context_window_for(tiny_model, EngineConfig(max_model_len=cfg_len + 1))


def test_the_generated_engine_config_lists_every_option_under_its_part_at_its_default(tmp_path):
    """The engine template lists no option: generate_repository() appends every option of
    backend/config.py (backend/serving/engine_parameters.py), part by part in field order under a
    comment naming the part, each at its default as from_dict reads it back, an --engine-option in
    place of its default; Triton's own parser reads the result."""
    template = (TEMPLATES / "engine" / "config.pbtxt").read_text()
    names = option_names()
    assert not set(declared_parameters(template)) & set(names)
    repo = generate_repository(tmp_path / "repo", model_dir("tiny"), models=["engine"],
                               engine_options={"role": "decode", "drain_file": 'd "q" \\ 你'})
    text = (repo / "engine" / "config.pbtxt").read_text()
    declared = declared_parameters(text)
    assert [k for k in declared if k in names] == list(names)
    assert set(declared) - set(names) == {"model_dir", *P.WEIGHTS_PARAMS}
    assert (declared["role"], declared["drain_file"]) == ("decode", 'd "q" \\ 你')
    cfg = text_format.Parse(text, mc.ModelConfig())
    assert {k: v.string_value for k, v in cfg.parameters.items()} == declared
    heading, under = None, {}
    for line in text.splitlines():
        if line.startswith("# ") and line[2:].split(":")[0] in {c.__name__ for c in PARTS.values()}:
            heading = line[2:].split(":")[0]
        elif (key := next(iter(declared_parameters(line)), None)) in names:
            under[key] = heading
    assert under == {k: PARTS[part].__name__ for k, part in names.items()}
    for part, cls in PARTS.items():
        for f in fields(cls):
            if f.name in ("role", "drain_file"):
                continue
            want = "" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
            assert declared[f.name] == want, f.name
            assert getattr(getattr(EngineArgs.from_dict({f.name: want}), part), f.name) == f.default, f.name
    defaults = declared_parameters(engine_parameters())
    assert list(defaults) == list(names) and EngineArgs.from_dict(defaults) == EngineArgs()


def test_engine_options_in_a_template_or_unknown_ones_are_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(TEMPLATES / "engine", src / "engine")
    cfg = src / "engine" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + 'parameters: { key: "block_size", value: { string_value: "8" } }\n')
    with pytest.raises(ValueError, match=r"lists engine options \['block_size'\]: they are generated"):
        generate_repository(tmp_path / "repo", model_dir("tiny"), models=["engine"], src=src)
    with pytest.raises(ValueError, match="unknown engine option.*'blok'"):
        generate_repository(tmp_path / "repo", model_dir("tiny"), models=["engine"], engine_options={"blok": "1"})

    @dataclass
    class Undocumented:                                  # dataclass makes up a docstring: no heading
        x: int = 0
    with pytest.raises(ValueError, match="Undocumented has no docstring"):
        part_heading(Undocumented)


def test_flat_options_reach_their_part_and_bad_ones_are_named():
    args = EngineArgs.from_dict({"block_size": "8", "role": "prefill", "max_loras": "2", "allow_client_salt": "on",
                                 "busy_hold_max": "0.5", "num_kv_blocks": " 12 "})
    assert (args.engine.block_size, args.engine.num_kv_blocks, args.disagg.role, args.lora.max_loras,
            args.tenancy.allow_client_salt, args.serving.busy_hold_max) == (8, 12, "prefill", 2, True, 0.5)
    assert EngineArgs(**args.options()) == args and EngineArgs(engine=args.engine).engine is args.engine
    for bad, match in [({"block_size": "8.5"}, "block_size must be an integer"),
                       ({"quant_lm_head": "maybe"}, "quant_lm_head must be one of"),
                       ({"priority_aging_s": "soon"}, "priority_aging_s must be a number"),
                       ({"test_faults": "true"}, "unknown engine option")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs.from_dict(bad)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineArgs(blocksize=8)
    with pytest.raises(TypeError, match="not both"):
        EngineArgs(engine=args.engine, block_size=4)


def test_generate_repository(tmp_path):
    tiny = model_dir("tiny")
    repo = generate_repository(tmp_path / "repo", tiny, engine_options={"block_size": "32",
                                                                        "max_model_len": "512"},
                               instances={"postprocessing": 3})
    assert sorted(p.name for p in repo.iterdir()) == ["engine", "llm", "postprocessing", "preprocessing"]
    eng = declared_parameters((repo / "engine" / "config.pbtxt").read_text())
    assert eng["model_dir"] == str(tiny.resolve()) and eng["block_size"] == "32"
    assert declared_parameters((repo / "preprocessing" / "config.pbtxt").read_text())["context_window"] == "512"
    assert "count: 3" in (repo / "postprocessing" / "config.pbtxt").read_text()
    assert (repo / "llm" / "1").is_dir()


def test_preprocessing_gets_the_engines_context_window_with_the_pool_clamp(tmp_path):
    """A pool of 8 blocks of 16 holds 128 tokens: preprocessing validates against 128, not the
    checkpoint's 1024 (it used to read config.json alone and admit prompts the engine rejects)."""
    repo = generate_repository(tmp_path / "repo", model_dir("tiny"), models=["preprocessing"],
                               engine_options={"num_kv_blocks": "8"})
    assert declared_parameters((repo / "preprocessing" / "config.pbtxt").read_text())["context_window"] == "128"


def test_engine_options_are_validated():
    assert parse_engine_options(["block_size=8", " dtype = bfloat16 "]) == {"block_size": "8", "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="unknown engine option 'blok'"):
        parse_engine_options(["blok=1"])
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        parse_engine_options(["block_size"])
    with pytest.raises(ValueError, match="bad engine option"):
        parse_engine_options(["block_size=big"])


def test_pbtxt_editing():
    text = 'parameters: { key: "a", value: { string_value: "x" } }\ninstance_group [ { count: 2, kind: KIND_CPU } ]'
    assert declared_parameters(set_parameter(text, "a", 'say "hi" \\ 你')) == {"a": 'say "hi" \\ 你'}
    with pytest.raises(KeyError):
        set_parameter(text, "b", "1")
    assert "count: 5" in set_instance_count(text, 5)


def test_engine_model_builds_the_disaggregated_roles():
    """role=prefill / decode: the engine model runs the role wrappers around the engine
    (backend/serving/disagg_engine.py); only a decode engine takes hand-over records."""
    from backend.serving.disagg_engine import DecodeEngine, DecodeLoop, PrefillEngine
    from backend.serving.engine_service import build_engine_service
    from tests.conftest import model_dir

    pre = build_engine_service(str(model_dir("tiny")), {"role": "prefill", "num_kv_blocks": "8"})
    dec = build_engine_service(str(model_dir("tiny")), {"role": "decode", "num_kv_blocks": "8"})
    try:
        assert isinstance(pre.loop.engine, PrefillEngine) and not getattr(pre.loop, "accepts_handover", False)
        assert isinstance(dec.loop, DecodeLoop) and isinstance(dec.loop.engine, DecodeEngine)
    finally:
        pre.shutdown(1.0)
        dec.shutdown(1.0)


def test_engine_model_passes_the_busy_hold_options_to_its_response_thread():
    """busy_stream_interval, busy_hold_steps and busy_hold_max as the engine model's parameters
    (strings, as Triton gives them) set its response thread's hold; left out, ServingConfig's defaults."""
    from backend.config import ServingConfig
    from backend.serving.engine_service import build_engine_service
    from tests.conftest import model_dir

    set_ = build_engine_service(str(model_dir("tiny")), {"num_kv_blocks": "8", "busy_stream_interval": "0.08",
                                                         "busy_hold_steps": "4.5", "busy_hold_max": "0.6"})
    default = build_engine_service(str(model_dir("tiny")), {"num_kv_blocks": "8"})
    try:
        r = set_.responses.hold
        assert (r.busy_stream_interval, r.busy_hold_steps, r.busy_hold_max) == (0.08, 4.5, 0.6)
        d, args = default.responses.hold, ServingConfig()
        assert (d.busy_stream_interval, d.busy_hold_steps, d.busy_hold_max) == \
            (args.busy_stream_interval, args.busy_hold_steps, args.busy_hold_max)
    finally:
        set_.shutdown(1.0)
        default.shutdown(1.0)
