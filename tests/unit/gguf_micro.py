"""A micro llama GGUF for the importer's safety tests, and a map of where its structural fields are.

The weights are a seeded checkpoint of one layer (hidden 32, 2 heads, 1 KV head, head size 16),
written by gguf-py's GGUFWriter with a mix of tensor types (F32, F16, Q8_0, Q4_0, Q4_1), so the
file is a few KB and imports in a fraction of a second, and every type path of the reader runs.
"""
from __future__ import annotations

import pathlib

import numpy as np

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "Ġ", "ab", "abc", "Ġa", "Ċ", "d"]
MERGES = ["a b", "ab c", "Ġ a"]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 32, 2, 1, 16, 64
TENSOR_TYPES = {"token_embd.weight": "F32", "output_norm.weight": "F32", "blk.0.attn_norm.weight": "F32",
                "blk.0.ffn_norm.weight": "F16", "blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "F16",
                "blk.0.attn_v.weight": "Q4_0", "blk.0.attn_output.weight": "Q4_1",
                "blk.0.ffn_gate.weight": "Q8_0", "blk.0.ffn_up.weight": "F32", "blk.0.ffn_down.weight": "Q8_0"}


def _shapes() -> dict[str, tuple[int, ...]]:
    v = len(TOKENS)
    return {"token_embd.weight": (v, HIDDEN), "output_norm.weight": (HIDDEN,),
            "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
            "blk.0.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            "blk.0.ffn_gate.weight": (INTER, HIDDEN), "blk.0.ffn_up.weight": (INTER, HIDDEN),
            "blk.0.ffn_down.weight": (HIDDEN, INTER)}


def metadata() -> dict[str, tuple[str, object]]:
    """key -> (GGUFValueType name, value): what :func:`write_micro` writes unless told otherwise."""
    return {
        "general.architecture": ("STRING", "llama"),
        "llama.context_length": ("UINT32", 128), "llama.embedding_length": ("UINT32", HIDDEN),
        "llama.block_count": ("UINT32", 1), "llama.feed_forward_length": ("UINT32", INTER),
        "llama.attention.head_count": ("UINT32", HEADS), "llama.attention.head_count_kv": ("UINT32", KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": ("FLOAT32", 1e-5), "llama.rope.freq_base": ("FLOAT32", 10000.0),
        "llama.vocab_size": ("UINT32", len(TOKENS)),
        "tokenizer.ggml.model": ("STRING", "gpt2"), "tokenizer.ggml.pre": ("STRING", "gpt-2"),
        "tokenizer.ggml.tokens": ("ARRAY", TOKENS),
        "tokenizer.ggml.token_type": ("ARRAY", [3, 3, 3] + [1] * (len(TOKENS) - 3)),
        "tokenizer.ggml.merges": ("ARRAY", MERGES),
        "tokenizer.ggml.eos_token_id": ("UINT32", 2), "tokenizer.ggml.padding_token_id": ("UINT32", 0),
        "tokenizer.ggml.add_bos_token": ("BOOL", False),
        "tokenizer.chat_template": ("STRING", "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"),
    }


def write_micro(path: pathlib.Path, meta: dict | None = None, seed: int = 0) -> pathlib.Path:
    """Write the micro GGUF; ``meta`` replaces (or, with value None, drops) metadata entries."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    entries = metadata()
    entries.update(meta or {})
    w = GGUFWriter(str(path), arch="llama")
    w.kv_data[0].pop("general.architecture")          # the writer adds it; the entries say what it is
    for key, entry in entries.items():
        if entry is None:
            continue
        vtype, value = entry
        if vtype == "ARRAY":
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, GGUFValueType[vtype])
    rng = np.random.default_rng(seed)
    for name, shape in _shapes().items():
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        qtype = TENSOR_TYPES[name]
        if qtype == "F32":
            w.add_tensor(name, data)
        elif qtype == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, quantize(data, GGMLQuantizationType[qtype]), raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def field_map(path: pathlib.Path) -> tuple[list[tuple[int, int, str]], int]:
    """(offset, size, what) of every length, count, type, dimension, offset and scalar value in the
    header of a valid file (read with gguf-py's reader, which is fine on a file we wrote), and the
    offset where tensor data starts."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(str(path))
    base = r.data.ctypes.data
    where = lambda part: (part.ctypes.data - base, part.nbytes)          # noqa: E731
    out = [(4, 4, "version"), (8, 8, "tensor count"), (16, 8, "metadata count")]
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        parts = f.parts
        out += [(*where(parts[0]), f"{key} key length"), (*where(parts[2]), f"{key} value type")]
        if f.types[0] == GGUFValueType.ARRAY:
            out += [(*where(parts[3]), f"{key} item type"), (*where(parts[4]), f"{key} array length")]
            if f.types[-1] == GGUFValueType.STRING:                     # item lengths: first, second, last
                out += [(*where(parts[i]), f"{key} item {n} length")
                        for n, i in (("0", 5), ("1", 7), ("last", len(parts) - 2))]
        elif f.types[0] == GGUFValueType.STRING:
            out.append((*where(parts[3]), f"{key} string length"))
        else:
            out.append((*where(parts[3]), f"{key} value"))
    for t in r.tensors:
        name_len, _, n_dims, dims, ggml_type, offset = t.field.parts
        out += [(*where(name_len), f"{t.name} name length"), (*where(n_dims), f"{t.name} dimension count"),
                (*where(ggml_type), f"{t.name} type"), (*where(offset), f"{t.name} offset")]
        out += [(where(dims)[0] + 8 * d, 8, f"{t.name} dimension {d}") for d in range(len(dims))]
    return out, r.data_offset
