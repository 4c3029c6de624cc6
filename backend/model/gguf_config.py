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
    kind = gf.get_str(gf.arch_key("rope.scaling.type"), None)
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta,
                "factor": _f32(gf.get_float(gf.arch_key("rope.scaling.factor"), hi=1e6))}
    raise GGUFError(f"{gf.path}: rope scaling {kind!r} is not supported (only none and linear)")


def hf_config(gf: GGUFFile, tok: TokenizerFiles, *, tensor_names: set[str], dtype: str = "float32"):
    """A ``transformers.PretrainedConfig`` for the file's shapes; GGUFError when a key is missing,
    has the wrong type or is out of range."""
    from transformers import AutoConfig

    a = gf.arch_key
    hidden = gf.get_int(a("embedding_length"), lo=1, hi=1 << 17)
    heads = gf.get_int(a("attention.head_count"), lo=1, hi=1 << 12)
    kv_heads = gf.get_int(a("attention.head_count_kv"), heads, lo=1, hi=heads)
    if heads % kv_heads:
        raise GGUFError(f"{gf.path}: {heads} attention heads do not split into {kv_heads} KV-head groups")
    head_dim = gf.get_int(a("attention.key_length"), hidden // heads, hi=1 << 12)
    if head_dim < 2 or head_dim % 2:
        raise GGUFError(f"{gf.path}: head size {head_dim} is not a positive even number (rotary "
                        "embeddings rotate pairs)")
    theta = _f32(gf.get_float(a("rope.freq_base"), 10000.0, hi=1e12))
    n_tokens = len(gf.get_strs("tokenizer.ggml.tokens", []))
    vocab = gf.get_int(a("vocab_size"), n_tokens, lo=1, hi=1 << 22)
    if n_tokens > vocab:
        raise GGUFError(f"{gf.path}: {n_tokens} tokens do not fit a vocabulary of {vocab}")
    sliding = gf.get_int(a("attention.sliding_window"), None, hi=1 << 24) if gf.architecture == "mistral" else None
    kw = dict(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=gf.get_int(a("feed_forward_length"), lo=1, hi=1 << 20),
        num_hidden_layers=gf.get_int(a("block_count"), lo=1, hi=1 << 12), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=gf.get_int(a("context_length"), 2048, lo=1, hi=1 << 24),
        rms_norm_eps=_f32(gf.get_float(a("attention.layer_norm_rms_epsilon"), 1e-6, hi=1.0)),
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
        kw["sliding_window"] = sliding
    return AutoConfig.for_model(model_type, **kw)


def generation_config(tok: TokenizerFiles) -> dict:
    """What ``generate()`` (and our engine) stop on: every end-of-generation id, greedy by default."""
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids,
            "pad_token_id": tok.pad_token_id, "do_sample": False}


def check_shapes(gf: GGUFFile, config, tensors) -> None:
    """Every tensor has the shape the metadata implies, and every required one is there (the checks
    llama.cpp's loader makes), so a checkpoint that imports also loads. GGUFError otherwise."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv, vocab = config.num_attention_heads * d, config.num_key_value_heads * d, config.vocab_size
    required = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    optional = {"lm_head.weight": (vocab, h)}
    # Which projections carry a bias: Qwen2 q/k/v always, Llama all four when attention_bias.
    bias = {"qwen2": "qkv", "llama": "qkvo" if getattr(config, "attention_bias", False) else ""}.get(
        config.model_type, "")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        required.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                         p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                         p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                         p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                         p + "mlp.down_proj.weight": (h, inter)})
        required.update({f"{p}self_attn.{x}_proj.bias": (q if x == "q" else kv if x in "kv" else h,)
                         for x in bias})
    seen = set()
    for t in tensors:
        want = required.get(t.name, optional.get(t.name))
        if want is None:
            raise GGUFError(f"{gf.path}: tensor {t.gguf_name} does not belong to a "
                            f"{config.num_hidden_layers}-layer {gf.architecture} model")
        if tuple(t.shape) != want:
            raise GGUFError(f"{gf.path}: tensor {t.gguf_name} has shape {tuple(t.shape)}, the metadata "
                            f"implies {want}")
        seen.add(t.name)
    missing = [n for n in required if n not in seen]
    if missing:
        raise GGUFError(f"{gf.path}: {len(missing)} tensors are missing, e.g. {missing[0]}")
