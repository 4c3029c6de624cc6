"""Read a llama-family GGUF file: its metadata and its tensors under Hugging Face names.

The ``gguf`` package (llama.cpp's own Python reader) memory-maps the file; this module only maps
names, checks types, and undoes the one layout change llama.cpp's converter makes: for the ``llama``
architecture it permutes the rows of ``q_proj`` / ``k_proj`` so that each head's rotary pairs are
interleaved (llama.cpp's rope), where Hugging Face keeps the two halves apart. Qwen2 is converted
without the permutation (its rope already matches).

Quantized tensors stay available as they are in the file (:attr:`GGUFTensor.raw`: one row of
packed blocks + scales per output row, already un-permuted), so later quantized inference can use
them without going through fp32; :meth:`GGUFTensor.dequantize` gives float32.
"""
from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

import numpy as np

# llama.cpp architectures whose weights follow the Llama layout this engine implements.
# "mistral" is not a separate GGUF architecture in older files (they say "llama"), newer
# converters may write it.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
# Tensor types gguf.quants can dequantize and that llama-family files use.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Architectures whose Q/K rows llama.cpp's converter permuted (see module docstring).
_PERMUTED = ("llama", "mistral")
_QK = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFError(ValueError):
    """The file is not a GGUF this importer supports; the message says what and why."""


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; GGUFError if unknown."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    if gguf_name == "rope_freqs.weight":
        raise GGUFError("rope_freqs.weight (llama3-style rope scaling stored as a tensor) is not "
                        "supported: its scaling parameters are not in the file")
    raise GGUFError(f"unexpected tensor {gguf_name!r} for a llama-family model")


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's ``permute`` on the first (output) axis.

    The converter turned each head's rows [first half | second half] into interleaved pairs; this
    puts them back. Works on float rows and on packed quantized rows alike (it moves whole rows)."""
    shape = rows.shape
    return (rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))


@dataclass
class GGUFTensor:
    """One tensor, in Hugging Face naming and (rows, cols) order."""
    name: str                          # Hugging Face name
    gguf_name: str
    qtype: str                         # GGML type name: F32, Q4_K, ...
    shape: tuple[int, ...]             # logical shape, HF order (out_features, in_features)
    raw: np.ndarray                    # as stored (un-permuted): float array, or uint8 packed rows

    @property
    def quantized(self) -> bool:
        return self.qtype not in ("F32", "F16", "BF16")

    def dequantize(self) -> np.ndarray:
        """float32 array of ``shape``."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if self.qtype == "F32":
            return np.array(self.raw, dtype=np.float32).reshape(self.shape)   # a copy: raw is the mmap
        if self.qtype == "F16":
            return np.asarray(self.raw).astype(np.float32).reshape(self.shape)
        return dequantize(np.asarray(self.raw), GGMLQuantizationType[self.qtype]).astype(
            np.float32, copy=False).reshape(self.shape)


class GGUFFile:
    """An open GGUF: ``.architecture``, ``.get(key)`` for metadata, ``.tensors()`` in HF naming."""

    def __init__(self, path: str | pathlib.Path) -> None:
        from gguf import GGUFReader

        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:                 # FileNotFoundError passes through
            if f.read(4) != b"GGUF":
                raise GGUFError(f"{self.path}: not a GGUF file (no GGUF magic at the start)")
        try:
            self._reader = GGUFReader(str(self.path))
        except (ValueError, OSError) as exc:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({exc})") from None
        self.architecture = str(self.get("general.architecture", ""))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {self.architecture!r} is not supported; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(self, key: str, default=None):
        """A metadata value (str, int, float, bool or list), or ``default`` when absent."""
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def arch(self, key: str, default=None):
        """An architecture-scoped value: ``arch("block_count")`` reads ``llama.block_count``."""
        return self.get(f"{self.architecture}.{key}", default)

    def tensors(self):
        """Yield every tensor as a :class:`GGUFTensor`; GGUFError on an unsupported type or name."""
        n_head = int(self.arch("attention.head_count"))
        n_kv = int(self.arch("attention.head_count_kv", n_head))
        for t in self._reader.tensors:
            qtype = t.tensor_type.name
            if qtype not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path}: tensor {t.name} has type {qtype}, which is not "
                                f"supported; supported: {', '.join(SUPPORTED_TYPES)}")
            name = hf_name(t.name)
            shape = tuple(int(d) for d in reversed(t.shape))   # GGUF lists ne0 (columns) first
            raw = t.data
            if self.architecture in _PERMUTED and name.endswith(_QK):
                heads = n_head if ".q_proj." in name else n_kv
                raw = unpermute_rows(np.asarray(raw).reshape(shape[0], -1), heads).reshape(np.shape(raw))
            yield GGUFTensor(name=name, gguf_name=t.name, qtype=qtype, shape=shape, raw=raw)


def quantized_tensors(path: str | pathlib.Path) -> dict[str, GGUFTensor]:
    """Every tensor of a GGUF in HF naming, still packed as in the file (for quantized inference)."""
    return {t.name: t for t in GGUFFile(path).tensors()}
