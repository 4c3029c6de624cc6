"""Make a local Hugging Face checkpoint directory from a preset, with a fixed seed.

No model can be downloaded here, so the project makes its own small Llama / Qwen2 checkpoints and
loads them through the same code that loads any Hugging Face checkpoint directory. Weights are drawn
from a seeded ``torch.Generator`` in sorted parameter order and written with safetensors, so the
same preset and seed give byte-identical files.
"""
from __future__ import annotations

import json
import math
import pathlib
import shutil

import torch

from backend.tokenizer_train import TOKENIZER_DIR

PRESETS: dict[str, dict] = {
    # ~4M parameters: Llama with GQA (4 query heads share 2 KV heads), tied embeddings.
    "tiny": dict(model_type="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=688, max_position_embeddings=1024,
                 tie_word_embeddings=True),
    # Qwen2: qkv bias, GQA, untied lm_head.
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=256, num_hidden_layers=3, num_attention_heads=8,
                       num_key_value_heads=2, intermediate_size=512, max_position_embeddings=1024,
                       tie_word_embeddings=False),
    # llama2.c "stories15M" shape.
    "bench-15m": dict(model_type="llama", hidden_size=288, num_hidden_layers=6, num_attention_heads=6,
                      num_key_value_heads=6, intermediate_size=768, max_position_embeddings=2048,
                      tie_word_embeddings=True),
    # llama2.c "stories110M" shape.
    "bench-110m": dict(model_type="llama", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=12, intermediate_size=2048, max_position_embeddings=2048,
                       tie_word_embeddings=True),
}


def _hf_config(preset: dict, vocab_size: int, eos_ids: list[int], pad_id: int):
    from transformers import AutoConfig

    kw = dict(preset)
    model_type = kw.pop("model_type")
    return AutoConfig.for_model(
        model_type, vocab_size=vocab_size, rms_norm_eps=1e-5, rope_theta=10000.0,
        hidden_act="silu", bos_token_id=None, eos_token_id=eos_ids[0], pad_token_id=pad_id,
        dtype="float32", **kw)


def _init_weights(names_shapes: list[tuple[str, tuple[int, ...]]], seed: int, hidden: int,
                  tied: bool) -> dict[str, torch.Tensor]:
    """Scaled so activations stay O(1) and logits are peaked: greedy ties are vanishingly rare,
    which keeps token-for-token comparisons against transformers meaningful."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(names_shapes):
        if name.endswith("norm.weight") or "layernorm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            # Tied embeddings double as the lm_head: keep them small so the layers, not the
            # input token's own embedding, decide the next token.
            t = torch.randn(shape, generator=gen) * (2.0 / math.sqrt(hidden) if tied else 1.0)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * (2.0 / math.sqrt(hidden))
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[name] = t.to(torch.float32).contiguous()
    return out


def make_model(preset: str, out: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"))
    vocab = tok.backend_tokenizer.get_vocab_size()
    eos_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config = _hf_config(PRESETS[preset], vocab, eos_ids, pad_id)

    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    state = _init_weights(shapes, seed, config.hidden_size, config.tie_word_embeddings)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)

    config.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos_ids, "pad_token_id": pad_id, "bos_token_id": None,
         "do_sample": False}, indent=2) + "\n")
    # One metadata key only: safetensors writes its metadata map in hash order, so several keys
    # would make the bytes differ between runs.
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, out / f.name)
    return out
