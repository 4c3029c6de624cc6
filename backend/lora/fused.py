"""A step's LoRA groups as the fused C step reads them (``kernels/csrc/lora_cpu.c``).

Per adapter, once (cached on the :class:`LoRAAdapter`, so it lives and dies with the weights a
request holds): a table of fp32 ``A [r, in]`` and ``Bt [r, out]`` pointers per layer and target
(B transposed, so the expand streams contiguous rows of it; bf16 adapters of a bf16 model are
widened, exactly). Per step: the :class:`~backend.lora.batch.LoRABatch` groups' rows back to back,
their offsets and their adapters' tables, in one :class:`CStep` whose address the step passes on.
"""
from __future__ import annotations

import ctypes

import torch

from backend.lora.adapter import TARGETS, LoRAAdapter
from backend.lora.batch import LoRABatch

_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Adapter(ctypes.Structure):
    """Mirror of ``LoraAdapter`` in kernels/csrc/lora_cpu.c."""
    _fields_ = [("rank", _I), ("scale", ctypes.c_float), ("a", _P), ("bt", _P)]


class _Step(ctypes.Structure):
    """Mirror of ``LoraStep`` in kernels/csrc/lora_cpu.c."""
    _fields_ = ([(n, _I) for n in ("hidden", "q_size", "kv_size", "inter", "num_layers", "ngroups")]
                + [("adapters", _P), ("offsets", _P), ("rows", _P)])


class _Table:
    """One adapter's C table and the fp32 tensors its pointers name."""

    def __init__(self, adapter: LoRAAdapter):
        a_ptrs, bt_ptrs, self._tensors = [], [], []
        for layer in adapter.layers:
            for target in TARGETS:
                ab = layer.get(target)
                if ab is None:
                    a_ptrs.append(None)
                    bt_ptrs.append(None)
                    continue
                a = ab[0].to(device="cpu", dtype=torch.float32).contiguous()
                bt = ab[1].to(device="cpu", dtype=torch.float32).t().contiguous()
                self._tensors += [a, bt]
                a_ptrs.append(a.data_ptr())
                bt_ptrs.append(bt.data_ptr())
        self._a = (_P * len(a_ptrs))(*a_ptrs)
        self._bt = (_P * len(bt_ptrs))(*bt_ptrs)
        self.struct = _Adapter(rank=adapter.rank, scale=adapter.scale, a=ctypes.cast(self._a, _P),
                               bt=ctypes.cast(self._bt, _P))


def table(adapter: LoRAAdapter) -> _Table:
    t = adapter.c_table
    if t is None:
        t = adapter.c_table = _Table(adapter)
    return t


class CStep:
    """One step's groups for ``lora_apply``; keeps every pointer's object alive while it lives.
    ``dims``: hidden, q_size, kv_size, inter, num_layers of the base model."""

    def __init__(self, lora: LoRABatch, *, hidden: int, q_size: int, kv_size: int, inter: int, num_layers: int):
        tables = [table(g.adapter) for g in lora.groups]
        self._rows = torch.cat([g.rows.to(device="cpu", dtype=torch.int64) for g in lora.groups]).contiguous()
        counts = [int(g.rows.shape[0]) for g in lora.groups]
        self._offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
        self._tables = tables
        self._adapters = (_P * len(tables))(*[ctypes.addressof(t.struct) for t in tables])
        self.struct = _Step(hidden=hidden, q_size=q_size, kv_size=kv_size, inter=inter, num_layers=num_layers,
                            ngroups=len(tables), adapters=ctypes.cast(self._adapters, _P),
                            offsets=self._offsets.data_ptr(), rows=self._rows.data_ptr())

    @classmethod
    def for_model(cls, lora: LoRABatch, cfg) -> CStep:
        """``cfg``: the base model's ModelConfig."""
        return cls(lora, hidden=cfg.hidden_size, q_size=cfg.num_heads * cfg.head_dim,
                   kv_size=cfg.num_kv_heads * cfg.head_dim, inter=cfg.intermediate_size, num_layers=cfg.num_layers)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.struct)


def rows_done() -> int:
    """Adapter rows x projections the fused C step has updated in this process (0 without the
    library): how tests and the benchmark see that adapter rows ran in C, not on the torch path."""
    from kernels.cpu import decode_library

    lib = decode_library()
    if lib is None:
        return 0
    lib.lora_rows_done.restype = ctypes.c_int64
    return int(lib.lora_rows_done())
