"""Read a llama-family GGUF file: its metadata and its tensors under Hugging Face names.

:mod:`backend.model.gguf_header` validates and parses the header (the file stays memory-mapped);
this module gives typed metadata (a wrong type is a GGUFError naming the key), maps names, checks
types, and undoes the one layout change llama.cpp's converter makes: for the ``llama``
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

from backend.model.gguf_header import ARRAY, SCALARS, STRING, TYPE_NAMES, GGUFError, read_header

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "hf_name", "quantized_tensors", "unpermute_rows"]

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


_INTS = (0, 1, 2, 3, 4, 5, 10, 11)
_FLOATS = (6, 12)
_MISSING = object()


def _plain(vtype: int, value):
    """A parsed value as plain Python (numeric arrays become lists)."""
    if vtype != ARRAY:
        return value
    item_type, items = value
    if item_type in SCALARS:
        return items.tolist()
    return [_plain(item_type, v) for v in items]


class GGUFFile:
    """An open, validated GGUF: ``.architecture``, typed metadata, ``.tensors()`` in HF naming."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self.header = read_header(self.path)           # GGUFError on any bad field; OSError passes
        self.architecture = self.get_str("general.architecture", "")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {self.architecture!r} is not supported; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def _typed(self, key: str, default, kinds: tuple[int, ...], expected: str):
        entry = self.header.metadata.get(key)
        if entry is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: metadata {key} is missing")
            return None, default
        vtype, value = entry
        if vtype not in kinds:
            raise GGUFError(f"{self.path}: metadata {key} has type {TYPE_NAMES.get(vtype, vtype)}, expected {expected}")
        return vtype, value

    def get(self, key: str, default=None):
        """A metadata value as plain Python (str, int, float, bool or list), or ``default``."""
        entry = self.header.metadata.get(key)
        return default if entry is None else _plain(*entry)

    def get_int(self, key: str, default=_MISSING, lo: int = 0, hi: int = 1 << 62):
        vtype, v = self._typed(key, default, _INTS, "an integer")
        if vtype is not None and not lo <= v <= hi:
            raise GGUFError(f"{self.path}: metadata {key} = {v} is out of range ({lo} to {hi})")
        return v

    def get_float(self, key: str, default=_MISSING, lo: float = 0.0, hi: float = 1e30):
        """A finite float in (lo, hi]: the values read this way are scales and frequencies."""
        vtype, v = self._typed(key, default, _FLOATS + _INTS, "a number")
        if vtype is not None and not lo < v <= hi:
            raise GGUFError(f"{self.path}: metadata {key} = {v} is out of range ({lo} to {hi})")
        return v

    def get_str(self, key: str, default=_MISSING):
        return self._typed(key, default, (STRING,), "a string")[1]

    def get_bool(self, key: str, default=_MISSING):
        vtype, v = self._typed(key, default, (7,), "a bool")
        return v

    def get_strs(self, key: str, default=_MISSING) -> list[str]:
        vtype, v = self._typed(key, default, (ARRAY,), "an array of strings")
        if vtype is not None and v[0] != STRING:
            raise GGUFError(f"{self.path}: metadata {key} is an array of type {TYPE_NAMES.get(v[0], v[0])}, "
                            "expected strings")
        return v if vtype is None else v[1]

    def get_ints(self, key: str, default=_MISSING) -> np.ndarray:
        vtype, v = self._typed(key, default, (ARRAY,), "an array of integers")
        if vtype is not None and v[0] not in _INTS:
            raise GGUFError(f"{self.path}: metadata {key} is an array of type {TYPE_NAMES.get(v[0], v[0])}, "
                            "expected integers")
        return v if vtype is None else v[1]

    def arch_key(self, key: str) -> str:
        """``arch_key("block_count")`` -> ``llama.block_count``."""
        return f"{self.architecture}.{key}"

    def arch(self, key: str, default=None):
        """An architecture-scoped value as plain Python: ``arch("block_count")``."""
        return self.get(self.arch_key(key), default)

    def _data(self, info) -> np.ndarray:
        """The tensor's bytes as gguf-py's reader shapes them (a view of the mapped file)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(info.ggml_type)
        dims = tuple(reversed(info.dims))
        if qtype.name in ("F32", "F16"):
            dtype = np.dtype("<f4" if qtype.name == "F32" else "<f2")
            count = info.nbytes // dtype.itemsize
        else:
            dtype, count, dims = np.dtype(np.uint8), info.nbytes, quant_shape_to_byte_shape(dims, qtype)
        return np.frombuffer(self.header.buffer, dtype=dtype, count=count, offset=info.offset).reshape(dims)

    def tensors(self):
        """Yield every tensor as a :class:`GGUFTensor`; GGUFError on an unsupported type or name."""
        from gguf.constants import GGMLQuantizationType

        n_head = self.get_int(self.arch_key("attention.head_count"), lo=1, hi=1 << 12)
        n_kv = self.get_int(self.arch_key("attention.head_count_kv"), n_head, lo=1, hi=n_head)
        for info in self.header.tensors:
            qtype = GGMLQuantizationType(info.ggml_type).name
            if qtype not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path}: tensor {info.name} has type {qtype}, which is not "
                                f"supported; supported: {', '.join(SUPPORTED_TYPES)}")
            try:
                name = hf_name(info.name)
            except GGUFError as exc:
                raise GGUFError(f"{self.path}: {exc}") from None
            shape = tuple(reversed(info.dims))            # GGUF lists ne0 (columns) first
            raw = self._data(info)
            if self.architecture in _PERMUTED and name.endswith(_QK):
                heads = n_head if ".q_proj." in name else n_kv
                if shape[0] % (2 * heads):
                    raise GGUFError(f"{self.path}: tensor {info.name} has {shape[0]} rows, not a whole "
                                    f"number of rotary pairs for {heads} heads")
                raw = unpermute_rows(raw.reshape(shape[0], -1), heads).reshape(raw.shape)
            yield GGUFTensor(name=name, gguf_name=info.name, qtype=qtype, shape=shape, raw=raw)


def quantized_tensors(path: str | pathlib.Path) -> dict[str, GGUFTensor]:
    """Every tensor of a GGUF in HF naming, still packed as in the file (for quantized inference)."""
    return {t.name: t for t in GGUFFile(path).tensors()}
