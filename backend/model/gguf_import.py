"""``triton-llm import-gguf FILE --out DIR``: a llama-family GGUF -> a Hugging Face checkpoint dir.

The directory holds config.json, generation_config.json, model.safetensors (or shards of about
2 GB with an index), tokenizer.json and tokenizer_config.json (with the chat template), and loads
in this engine and in transformers like any other checkpoint. Weights are dequantized to the
chosen dtype (float32 by default: the exact values of the quantized blocks); the packed blocks stay
readable through :func:`backend.model.gguf_reader.quantized_tensors`.

The file is validated before anything is written (:mod:`backend.model.gguf_header`: structure;
the reader, config and tokenizer modules: metadata types and ranges, tensor shapes against the
metadata), and the directory is placed by :mod:`backend.model.gguf_output`: built beside ``out``,
moved in at the end, never over files an import did not write.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import time
from dataclasses import dataclass, field

from backend.model import gguf_output
from backend.model.gguf_config import check_shapes, generation_config, hf_config
from backend.model.gguf_reader import GGUFFile
from backend.model.gguf_tokenizer import build_tokenizer

SHARD_BYTES = 2 << 30
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ImportResult:
    out: pathlib.Path
    seconds: float
    architecture: str
    tensor_types: dict[str, int] = field(default_factory=dict)   # GGML type -> tensor count
    parameters: int = 0


def _write_weights(tensors, tmp: pathlib.Path, dtype: str, progress) -> tuple[int, set[str]]:
    import torch
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    shards: list[dict] = [{}]
    size = params = 0
    names: set[str] = set()
    for i, t in enumerate(tensors):
        w = torch.from_numpy(t.dequantize()).to(target).contiguous()
        if size and size + w.numel() * w.element_size() > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][t.name] = w
        size += w.numel() * w.element_size()
        params += w.numel()
        names.add(t.name)
        if progress and (i + 1) % 50 == 0:
            progress(f"  {i + 1} tensors dequantized")
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return params, names
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(w.numel() * w.element_size() for s in shards for w in s.values())},
         "weight_map": weight_map}, indent=2) + "\n")
    return params, names


def import_gguf(path: str | pathlib.Path, out: str | pathlib.Path, *, dtype: str = "float32",
                progress=print, keep_quantized: bool = False) -> ImportResult:
    """Convert one GGUF; GGUFError (a ValueError) when the file is bad or not supported, or ``out``
    may not be written (a non-empty directory that is not a previous import), before writing.

    ``keep_quantized``: the layer projections keep their Q8_0 / Q4_0 / Q4_1 blocks in our int8 /
    int4 layouts (backend/quant/gguf.py) and config.json gets a ``quantization_config``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    start = time.perf_counter()
    out = pathlib.Path(out)
    target = pathlib.Path(os.path.abspath(out))           # "--out ." has a name and a parent
    gguf_output.check_target(target)
    gf = GGUFFile(path)
    tok = build_tokenizer(gf)
    tensors = list(gf.tensors())          # checks every name and type before anything is written
    config = hf_config(gf, tok, tensor_names={t.name for t in tensors}, dtype=dtype)
    check_shapes(gf, config, tensors)
    types = dict(collections.Counter(t.qtype for t in tensors))
    if progress:
        progress(f"[import-gguf] {pathlib.Path(path).name}: {gf.architecture}, {len(tensors)} tensors "
                 f"({', '.join(f'{n} {k}' for k, n in sorted(types.items()))}) -> {out} ({dtype})")
    tmp = gguf_output.staging_dir(target)
    try:
        if keep_quantized:
            import numpy as np
            from backend.quant.gguf import quantized_state
            from safetensors.torch import save_file
            state, qconfig, counts = quantized_state(tensors, dtype, progress)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            params, names = sum(int(np.prod(t.shape)) for t in tensors), {t.name for t in tensors}
            if progress:
                progress(f"[import-gguf] kept quantized: {qconfig['source']} -> bits={qconfig['bits']} ({counts})")
        else:
            params, names = _write_weights(tensors, tmp, dtype, progress)
        if keep_quantized:
            config.quantization_config = qconfig
        config.save_pretrained(tmp)
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(tok), indent=2) + "\n")
        tok.save(tmp)
        gguf_output.put_in_place(tmp, target, source=pathlib.Path(path).name)
    except BaseException:
        gguf_output.discard(tmp)
        raise
    result = ImportResult(out=out, seconds=time.perf_counter() - start, architecture=gf.architecture,
                          tensor_types=types, parameters=params)
    if progress:
        progress(f"[import-gguf] wrote {out} ({params / 1e6:.1f}M parameters) in {result.seconds:.1f}s")
    return result
