"""``import-gguf`` round trip: a tiny preset written to GGUF by the ``gguf`` package (the way
llama.cpp's converter writes it, Q/K rows permuted for llama) imports back to the same weights
(F32) or within the quantization error (Q8_0, Q4_0), with the same tokenizer, and the engine runs it.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from backend.model.gguf_import import import_gguf
from backend.model.gguf_reader import GGUFError, quantized_tensors
from backend.model.loader import iter_checkpoint
from tests.conftest import model_dir

_HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: each head's halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(src: pathlib.Path, path: pathlib.Path, qtype: str = "F32", arch: str | None = None,
               extra_tensor: tuple[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write checkpoint ``src`` as a GGUF; matrices whose rows split into 32-blocks get ``qtype``.
    Returns the HF state dict that was written (float32)."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    arch = arch or cfg["model_type"]
    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = tok["model"]["vocab"]
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(json.loads((src / "tokenizer_config.json").read_text())["chat_template"])

    state = {name: t.float().numpy() for name, t in iter_checkpoint(src)}
    for name, arr in state.items():
        data = arr
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            data = _llama_cpp_permute(arr, heads)
        if qtype != "F32" and arr.ndim == 2 and arr.shape[1] % 32 == 0:
            w.add_tensor(_gguf_name(name), quantize(data, GGMLQuantizationType[qtype]),
                         raw_dtype=GGMLQuantizationType[qtype])
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(data))
    if extra_tensor:
        w.add_tensor(*extra_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


def _imported(out: pathlib.Path) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in iter_checkpoint(out)}


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_f32_round_trip_is_exact(tmp_path, preset):
    src = model_dir(preset)
    state = write_gguf(src, tmp_path / "m.gguf")
    import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=None)
    got = _imported(tmp_path / "out")
    assert got.keys() == state.keys()
    for name, arr in state.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)

    a, b = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "out"))
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings",
                "rope_parameters"):
        assert a[key] == b[key], key
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == 2                      # <|im_end|>, from the file's EOS

    from transformers import AutoTokenizer
    t_src, t_out = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in ["Hello world, 12345!", "  spaces\n\nnew lines\tand tabs ", "naïve café 💡"]:
        assert t_out.encode(text) == t_src.encode(text), text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert (t_out.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
            == t_src.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))


# Largest error one step of the grid can make, relative to the block's largest magnitude.
STEP = {"Q8_0": 1 / 127, "Q4_0": 1 / 7}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_round_trip_within_error(tmp_path, qtype):
    state = write_gguf(model_dir("tiny"), tmp_path / "m.gguf", qtype=qtype)
    import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=None)
    got = _imported(tmp_path / "out")
    quantized = 0
    for name, arr in state.items():
        err = np.abs(got[name] - arr)
        if arr.ndim == 2 and arr.shape[1] % 32 == 0:
            blocks = np.abs(arr).reshape(arr.shape[0], -1, 32).max(-1, keepdims=True)
            bound = np.broadcast_to(blocks * STEP[qtype], (*blocks.shape[:2], 32)).reshape(arr.shape)
            assert (err <= bound * 1.001 + 1e-7).all(), f"{name}: max error {err.max()}"
            assert err.max() > 0, f"{name} was not quantized"
            quantized += 1
        else:
            np.testing.assert_array_equal(got[name], arr, err_msg=name)
    assert quantized >= 4 * 5                               # q/k/v/o/gate/up per layer at least

    # The packed blocks stay available (un-permuted) for quantized inference.
    packed = quantized_tensors(tmp_path / "m.gguf")
    q = packed["model.layers.0.self_attn.q_proj.weight"]
    assert q.qtype == qtype and q.quantized and q.raw.dtype == np.uint8
    np.testing.assert_array_equal(q.dequantize(), got["model.layers.0.self_attn.q_proj.weight"])


def test_engine_runs_the_imported_checkpoint(tmp_path):
    from backend.llm import LLM
    from backend.engine.admission import SamplingParams

    src = model_dir("tiny")
    write_gguf(src, tmp_path / "f32.gguf")
    write_gguf(src, tmp_path / "q8.gguf", qtype="Q8_0")
    import_gguf(tmp_path / "f32.gguf", tmp_path / "f32", progress=None)
    import_gguf(tmp_path / "q8.gguf", tmp_path / "q8", progress=None)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = "Once upon a time"
    ref = LLM(str(src), num_kv_blocks=64).generate(prompt, params)[0].outputs[0].token_ids
    f32 = LLM(str(tmp_path / "f32"), num_kv_blocks=64).generate(prompt, params)[0].outputs[0].token_ids
    q8 = LLM(str(tmp_path / "q8"), num_kv_blocks=64).generate(prompt, params)[0].outputs[0].token_ids
    assert f32 == ref                                       # the same weights: the same tokens
    assert len(q8) == 12 and sum(a == b for a, b in zip(q8, ref)) >= 6   # close, not exact


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    write_gguf(model_dir("tiny"), tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported; supported: llama"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    extra = ("blk.0.attn_sinks.weight", quantize(np.ones((4, 256), np.float32), GGMLQuantizationType.TQ2_0))
    write_gguf(model_dir("tiny"), tmp_path / "m.gguf", extra_tensor=(*extra, None, GGMLQuantizationType.TQ2_0))
    with pytest.raises(GGUFError, match="type TQ2_0, which is not supported; supported: F32"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()


def test_cli_reports_a_non_gguf_file(tmp_path, capsys):
    from triton_llm.cli import main

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert main(["import-gguf", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "not a GGUF file" in capsys.readouterr().err
