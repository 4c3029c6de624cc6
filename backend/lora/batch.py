"""LoRABatch: one step's tokens grouped by adapter, and the low-rank products added per group.

The step's rows are flattened across sequences; each adapter's rows are gathered, multiplied
through its A then B, scaled and added back into the projection output. Base-model rows are
never touched::

    rows     [ s0: base ........ | s1: "a" | s2: "b" ..... | s3: "a" ]
    groups   "a": rows of s1 + s3        "b": rows of s2
    out[rows_a, cols(q)] += scale_a * (x[rows_a] @ A_q^T) @ B_q^T      (index_select / index_add_)

The fused projections hold several targets side by side (``backend/model/llama.py``): qkv_proj's
columns are [q | k | v], gate_up_proj's [gate | up]; each target adds into its own column slice.

Two ways to run a group, chosen once per step (:func:`lora_kernel`, like the attention backend):
torch (index_select, two matmuls, index_add_) or the OpenAI-Triton shrink / expand of
``kernels/lora.py`` (the gather and the scatter-add fused into the GEMMs) on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.lora.adapter import LoRAAdapter


def lora_kernel(name: str, device: str | torch.device) -> str:
    """``auto``: the Triton kernels on CUDA, torch elsewhere (the CPU's fused C step reads the
    groups itself: backend/lora/fused.py). ``triton`` on CPU needs TRITON_INTERPRET=1 (tests)."""
    from kernels.device import triton_available

    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"lora kernel must be auto, torch or triton (got {name!r})")
    kind = torch.device(device).type
    if name == "auto":
        name = "triton" if kind == "cuda" and triton_available("cuda") else "torch"
    if name == "triton" and not triton_available(kind):
        raise ValueError(f"lora kernel 'triton' cannot run on {kind} here: it needs CUDA, or "
                         "TRITON_INTERPRET=1 set before start-up for CPU (slow, for tests)")
    return name


@dataclass
class _Group:
    adapter: LoRAAdapter
    rows: torch.Tensor            # [n] int64 row indices of the step's flattened tokens


class LoRABatch:
    def __init__(self, groups: list[_Group], slices: dict[str, list[tuple[str, int, int]]], kernel: str = "torch"):
        self.groups = groups
        self.slices = slices      # fused module -> [(target, first column, end column)]
        self.kernel = kernel      # "torch" | "triton" (resolved by lora_kernel)

    @classmethod
    def build(cls, spans: list[tuple[LoRAAdapter | None, int]], *, q_size: int, kv_size: int,
              intermediate: int, device: str | torch.device = "cpu", kernel: str = "auto") -> LoRABatch | None:
        """``spans``: each scheduled chunk's adapter (None = base) and its token count, in row
        order. None when no chunk has an adapter (the step needs no LoRA work). ``kernel``: auto |
        torch | triton (:func:`lora_kernel`)."""
        kernel = lora_kernel(kernel, device)
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
        return cls(groups, slices, kernel)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """``out[rows, cols(target)] += scale * (x[rows] @ A^T) @ B^T`` for every group whose
        adapter targets a part of ``module`` (in place; ``out`` is [num_tokens, out_features])."""
        if self.kernel == "triton":
            self._add_triton(out, x, layer, module)
            return
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

    def _add_triton(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """The same sums through kernels/lora.py: the shrink gathers the group's rows of ``x``
        itself and keeps ``t`` in fp32; the expand adds into the rows and column slice in place."""
        from kernels import lora as kl   # late: TRITON_INTERPRET is read when kernels/ is imported

        x = x if x.stride(1) == 1 else x.contiguous()
        assert out.stride(1) == 1, "the projection output must have unit column stride"
        for g in self.groups:
            weights = g.adapter.layers[layer]
            for target, c0, c1 in self.slices[module]:
                ab = weights.get(target)
                if ab is not None:
                    t = kl.lora_shrink(x, g.rows, ab[0])
                    kl.lora_expand(t, ab[1], out, g.rows, col0=c0, scale=g.adapter.scale)
