"""LoRABatch: one step's tokens grouped by adapter, and the low-rank products added per group.

The step's rows are flattened across sequences; each adapter's rows are gathered, multiplied
through its A then B, scaled and added back into the projection output. Base-model rows are
never touched::

    rows     [ s0: base ........ | s1: "a" | s2: "b" ..... | s3: "a" ]
    groups   "a": rows of s1 + s3        "b": rows of s2
    out[rows_a, cols(q)] += scale_a * (x[rows_a] @ A_q^T) @ B_q^T      (index_select / index_add_)

The fused projections hold several targets side by side (``backend/model/llama.py``): qkv_proj's
columns are [q | k | v], gate_up_proj's [gate | up]; each target adds into its own column slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.lora.adapter import LoRAAdapter


@dataclass
class _Group:
    adapter: LoRAAdapter
    rows: torch.Tensor            # [n] int64 row indices of the step's flattened tokens


class LoRABatch:
    def __init__(self, groups: list[_Group], slices: dict[str, list[tuple[str, int, int]]]):
        self.groups = groups
        self.slices = slices      # fused module -> [(target, first column, end column)]

    @classmethod
    def build(cls, spans: list[tuple[LoRAAdapter | None, int]], *, q_size: int, kv_size: int,
              intermediate: int, device: str | torch.device = "cpu") -> LoRABatch | None:
        """``spans``: each scheduled chunk's adapter (None = base) and its token count, in row
        order. None when no chunk has an adapter (the step needs no LoRA work)."""
        by_adapter: dict[str, tuple[LoRAAdapter, list[int]]] = {}
        start = 0
        for adapter, n in spans:
            if adapter is not None:
                # Keyed by uid, not name: a stream started before its adapter was replaced keeps
                # the weights it started with.
                by_adapter.setdefault(adapter.uid, (adapter, []))[1].extend(range(start, start + n))
            start += n
        if not by_adapter:
            return None
        groups = [_Group(a, torch.tensor(rows, dtype=torch.int64, device=device)) for a, rows in by_adapter.values()]
        qk = q_size + kv_size
        slices = {"qkv": [("q_proj", 0, q_size), ("k_proj", q_size, qk), ("v_proj", qk, qk + kv_size)],
                  "o": [("o_proj", 0, -1)],
                  "gate_up": [("gate_proj", 0, intermediate), ("up_proj", intermediate, 2 * intermediate)],
                  "down": [("down_proj", 0, -1)]}
        return cls(groups, slices)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """``out[rows, cols(target)] += scale * (x[rows] @ A^T) @ B^T`` for every group whose
        adapter targets a part of ``module`` (in place; ``out`` is [num_tokens, out_features])."""
        for g in self.groups:
            weights = g.adapter.layers[layer]
            xs = None
            for target, c0, c1 in self.slices[module]:
                ab = weights.get(target)
                if ab is None:
                    continue
                if xs is None:
                    xs = x.index_select(0, g.rows)
                # PEFT's order: B(A(x)) then * scaling, then added to the base output.
                delta = F.linear(F.linear(xs, ab[0]), ab[1]) * g.adapter.scale
                cols = out[:, c0:] if c1 == -1 else out[:, c0:c1]
                cols.index_add_(0, g.rows, delta)
