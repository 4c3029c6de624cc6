"""A GGUF's architecture metadata -> a transformers ``config.json`` + ``generation_config.json``.

The config is built by transformers itself (``AutoConfig.for_model``), so it is written in the
installed version's layout (transformers 5: ``rope_parameters``, ``dtype``) and loads in both
transformers and :mod:`backend.model.config`.
"""
from __future__ import annotations

from backend.model.gguf_reader import GGUFError, GGUFFile
from backend.model.gguf_tokenizer import TokenizerFiles

# GGUF architecture -> transformers model_type (old Mistral files say "llama": same weights).
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def _f32(value) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    import numpy as np

    return float(repr(np.float32(value)))


def _rope_parameters(gf: GGUFFile, theta: float) -> dict:
    kind = gf.arch("rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": _f32(gf.arch("rope.scaling.factor"))}
    raise GGUFError(f"{gf.path}: rope scaling {kind!r} is not supported (only none and linear)")


def hf_config(gf: GGUFFile, tok: TokenizerFiles, *, tensor_names: set[str], dtype: str = "float32"):
    """A ``transformers.PretrainedConfig`` for the file's shapes; GGUFError when keys are missing."""
    from transformers import AutoConfig

    def need(key: str):
        value = gf.arch(key)
        if value is None:
            raise GGUFError(f"{gf.path}: metadata {gf.architecture}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(gf.arch("attention.head_count_kv", heads))
    head_dim = int(gf.arch("attention.key_length", hidden // heads))
    theta = _f32(gf.arch("rope.freq_base", 10000.0))
    vocab = int(gf.arch("vocab_size", len(gf.get("tokenizer.ggml.tokens") or [])))
    kw = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=int(gf.arch("context_length", 2048)),
        rms_norm_eps=_f32(gf.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(gf, theta), hidden_act="silu",
        tie_word_embeddings="lm_head.weight" not in tensor_names,
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_ids[0] if tok.eos_token_ids else None, dtype=dtype)
    model_type = MODEL_TYPES[gf.architecture]
    if model_type == "llama":
        kw["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensor_names
        kw["mlp_bias"] = False
    if model_type == "qwen2":
        kw["use_sliding_window"] = False
    if model_type == "mistral":
        kw["sliding_window"] = gf.arch("attention.sliding_window")
    return AutoConfig.for_model(model_type, **kw)


def generation_config(tok: TokenizerFiles) -> dict:
    """What ``generate()`` (and our engine) stop on: every end-of-generation id, greedy by default."""
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids,
            "pad_token_id": tok.pad_token_id, "do_sample": False}
