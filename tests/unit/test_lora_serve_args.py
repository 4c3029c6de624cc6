"""``triton-llm serve --lora NAME=DIR`` -> engine options lora_modules / max_loras."""
from __future__ import annotations

import json

import pytest

from triton_llm.cli import build_parser
from backend.config import EngineArgs
from backend.lora.serve_args import lora_engine_options, parse_lora_args


def test_lora_args_to_engine_options(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = build_parser().parse_args(["serve", "--lora", f"a={tmp_path / 'a'}", "--lora", f"b={tmp_path / 'b'}"])
    loras = parse_lora_args(args.lora)
    assert loras == {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    opts = lora_engine_options(loras, ["num_threads=1"])
    parsed = EngineArgs.from_dict(dict(o.split("=", 1) for o in opts))
    assert parsed.lora.max_loras == 2 and json.loads(parsed.lora.lora_modules) == loras
    assert "max_loras=1" in lora_engine_options(loras, ["max_loras=1"]) and \
        "max_loras=2" not in lora_engine_options(loras, ["max_loras=1"])
    assert lora_engine_options({}, ["x=1"]) == ["x=1"]


@pytest.mark.parametrize("value,msg", [("noequals", "expected NAME=DIR"), ("a=", "expected NAME=DIR"),
                                       ("a=/no/such/dir", "not a directory")])
def test_bad_lora_args(value, msg):
    with pytest.raises(ValueError, match=msg):
        parse_lora_args([value])


def test_twice_and_both_ways(tmp_path):
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_args([f"a={tmp_path}", f"a={tmp_path}"])
    with pytest.raises(ValueError, match="not both"):
        lora_engine_options({"a": str(tmp_path)}, ["lora_modules={}"])
    with pytest.raises(ValueError, match="lora_modules needs max_loras"):
        EngineArgs(lora_modules='{"a": "/x"}')
