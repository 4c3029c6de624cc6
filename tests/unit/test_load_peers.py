"""The llama.cpp peer harness's pure parts: commands, config staging, SSE parsing, the workload and
the table. (Building llama-server takes minutes: never in tests.)"""
from __future__ import annotations

import json
import pathlib
import statistics

import pytest

from load.backends import DONE, completion_body, parse_completion_line
from load.llamacpp import (QUANT_METHODS, QUANT_TYPES, cmake_build_cmd, cmake_configure_cmd, convert_cmd, quantize_cmd,
                           quantize_gguf, server_cmd, staged_config)
from load.peers import peer_spec, quant_weights
from load.workloads import make_workload


def test_cmake_builds_only_the_server_without_network_features():
    cfg = cmake_configure_cmd(pathlib.Path("/src"), pathlib.Path("/b"))
    assert cfg[:5] == ["cmake", "-S", "/src", "-B", "/b"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):
        assert flag in cfg
    assert cmake_build_cmd(pathlib.Path("/b"), 2) == ["cmake", "--build", "/b", "--target", "llama-server", "-j", "2"]


def test_quantize_cmd_and_types():
    assert cmake_build_cmd(pathlib.Path("/b"), 2, "llama-quantize")[4] == "llama-quantize"
    cmd = quantize_cmd(pathlib.Path("/bin/llama-quantize"), pathlib.Path("f32.gguf"), pathlib.Path("o.gguf"), "q4_0", 2)
    assert cmd == ["/bin/llama-quantize", "f32.gguf", "o.gguf", "Q4_0", "2"]
    assert QUANT_TYPES == {"q8_0": "Q8_0", "q4_0": "Q4_0"} and QUANT_METHODS == {"q8_0": "int8", "q4_0": "int4"}
    with pytest.raises(ValueError, match="q8_0"):
        quantize_gguf(pathlib.Path("/nowhere"), "q5_k")          # refused before converting anything


def test_quant_weights_reports_both_sides(tmp_path):
    from tests.conftest import model_dir

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 1000)
    w8 = quant_weights(gguf, model_dir("tiny"), {"quantization": "int8"})
    assert w8["gguf_file_bytes"] == 1000 and w8["ours_method"] == "int8"
    assert w8["ours_weight_bytes"] < quant_weights(gguf, model_dir("tiny"), {})["ours_weight_bytes"] / 2


def test_server_cmd_splits_the_context_over_slots():
    cmd = server_cmd(pathlib.Path("/bin/llama-server"), pathlib.Path("m.gguf"), 8080, parallel=16, threads=2,
                     ctx_per_slot=1024)
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert cmd[0] == "/bin/llama-server"
    assert args["-m"] == "m.gguf" and args["--port"] == "8080" and args["--host"] == "127.0.0.1"
    assert args["-np"] == "16" and args["-c"] == str(16 * 1024) and args["-t"] == "2" and args["-tb"] == "2"
    assert "-ctk" not in cmd                                     # llama.cpp's own KV default (f16)
    same = server_cmd(pathlib.Path("s"), pathlib.Path("m"), 1, parallel=1, threads=1, ctx_per_slot=8,
                      dtype="bfloat16", cache_type="same")
    assert same[same.index("-ctk") + 1] == same[same.index("-ctv") + 1] == "bf16"
    q8 = server_cmd(pathlib.Path("s"), pathlib.Path("m"), 1, parallel=1, threads=1, ctx_per_slot=8, cache_type="q8_0")
    assert q8[q8.index("-ctk") + 1] == "q8_0"


def test_staged_config_adds_architecture_and_rope_theta():
    cfg = {"model_type": "llama", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    out = staged_config(cfg)
    assert out["architectures"] == ["LlamaForCausalLM"] and out["rope_theta"] == 500000.0
    assert "architectures" not in cfg                           # the checkpoint's own config is untouched
    assert staged_config({"model_type": "qwen2", "architectures": ["X"], "rope_theta": 1.0}) == \
        {"model_type": "qwen2", "architectures": ["X"], "rope_theta": 1.0}
    with pytest.raises(KeyError):
        staged_config({"model_type": "gpt2"})


def test_convert_cmd_picks_the_outtype_of_the_dtype():
    cmd = convert_cmd(pathlib.Path("/tree"), pathlib.Path("/stage"), pathlib.Path("/o.gguf"), "bfloat16")
    assert cmd[3:] == ["/tree", "/stage", "--outfile", "/o.gguf", "--outtype", "bf16"]
    assert "gpt-2" in cmd[2]                                     # unknown pre-tokenizer -> gpt-2
    assert convert_cmd(pathlib.Path("/t"), pathlib.Path("/s"), pathlib.Path("/o"), "float32")[-1] == "f32"


def test_completion_body_is_greedy_ignore_eos_streamed():
    body = completion_body("m", [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}], 7)
    assert body["prompt"] == "sys\nhi" and body["max_tokens"] == 7
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_parse_completion_lines():
    assert parse_completion_line("") is None and parse_completion_line(": keep-alive") is None
    assert parse_completion_line("data: [DONE]") is DONE
    p = parse_completion_line("data: " + json.dumps({"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}))
    assert p.text == "ab" and p.has_content and p.finish_reason is None
    last = parse_completion_line("data: " + json.dumps(
        {"choices": [{"text": "", "finish_reason": "length"}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 2}}}))
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens, last.cached_tokens) == ("length", 5, 9, 2)
    assert not last.has_content
    with pytest.raises(RuntimeError, match="stream error"):
        parse_completion_line('data: {"error": {"message": "bad"}}')


def test_peer_workload_lengths():
    jobs = make_workload(peer_spec(16, 1.0))
    assert len(jobs) == 64 and len(make_workload(peer_spec(1, 1.0))) == 16
    assert all(16 <= j.prompt_len <= 256 for j in jobs)
    outs = [t.max_tokens for j in make_workload(peer_spec(16, 8.0)) for t in j.turns]
    assert max(outs) <= 256 and min(outs) >= 1
    assert 50 < statistics.mean(outs) < 80                       # exponential, mean 64
    assert [t.max_tokens for j in jobs for t in j.turns] == [t.max_tokens for j in make_workload(peer_spec(16, 1.0))
                                                              for t in j.turns]
