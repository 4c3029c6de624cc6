"""Request parameters, error tags and model-repository generation (no server)."""
from __future__ import annotations

import math
from dataclasses import fields

import pytest

from backend.config import EngineArgs
from backend.serving.errors import RequestError, tagged
from backend.serving.repository import (TEMPLATES, declared_parameters, generate_repository,
                                        parse_engine_options, set_instance_count, set_parameter)
from backend.serving.request_params import fit_context, parse_parameters, request_settings


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
    with pytest.raises(RequestError) as info:
        request_settings(params)
    assert str(info.value).startswith(f"[invalid_request param={param}] ")


def test_parameters_json_errors():
    with pytest.raises(RequestError, match=r"param=parameters"):
        parse_parameters("{nope")
    assert parse_parameters("") == {} and parse_parameters(None) == {}


def test_fit_context():
    s = request_settings({})
    fit_context(s, 60, 64, "text_input")                # a default max_tokens shrinks to fit
    assert s.sampling.max_tokens == 4
    with pytest.raises(RequestError, match=r"param=max_tokens"):
        fit_context(request_settings({"max_tokens": 5}), 60, 64, "text_input")
    with pytest.raises(RequestError, match=r"param=text_input\] the prompt has 64 tokens"):
        fit_context(request_settings({}), 64, 64, "text_input")
    with pytest.raises(RequestError, match=r"param=min_tokens"):
        fit_context(request_settings({"min_tokens": 9, "max_tokens": 4}), 3, 64, "text_input")


def test_tagged_keeps_existing_tags_and_names_params():
    from backend.engine.errors import QueueFullError

    assert tagged(QueueFullError("full", retry_after=3)).kind == "queue_full"
    assert str(tagged(ValueError("top_p must be in (0, 1]"))).startswith("[invalid_request param=top_p]")
    assert tagged(RuntimeError("[unavailable] down")).kind == "unavailable"
    assert str(tagged(KeyError("x"))).startswith("[internal] KeyError")


def test_every_engine_arg_is_a_config_parameter():
    declared = declared_parameters((TEMPLATES / "engine" / "config.pbtxt").read_text())
    assert {f.name for f in fields(EngineArgs)} | {"model_dir"} == set(declared)
    defaults = EngineArgs()
    for f in fields(EngineArgs):                        # the template's values are the defaults
        assert getattr(EngineArgs.from_dict({f.name: declared[f.name]}), f.name) == getattr(defaults, f.name)


def test_generate_repository(tmp_path):
    repo = generate_repository(tmp_path / "repo", "/models/x", engine_options={"block_size": "32",
                                                                                "max_model_len": "512"},
                               instances={"postprocessing": 3})
    assert sorted(p.name for p in repo.iterdir()) == ["engine", "llm", "postprocessing", "preprocessing"]
    eng = declared_parameters((repo / "engine" / "config.pbtxt").read_text())
    assert eng["model_dir"] == "/models/x" and eng["block_size"] == "32"
    assert declared_parameters((repo / "preprocessing" / "config.pbtxt").read_text())["max_model_len"] == "512"
    assert "count: 3" in (repo / "postprocessing" / "config.pbtxt").read_text()
    assert (repo / "llm" / "1").is_dir()


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
