"""OpenAI-Triton kernels for the engine, each with a torch reference in ``kernels.reference``.

    store_kv_cache   write this step's K/V into the paged pool by slot mapping
    paged_attention  varlen causal GQA attention over block tables, mixed prefill/decode
    rms_norm         (residual add +) RMSNorm, transformers' numerics
    rope             rotary embedding in place on query and key (neox halves)

The Triton path runs on CUDA tensors, or on CPU tensors under the Triton interpreter when
``TRITON_INTERPRET=1`` was set before this package was imported.  ``triton_available()``
says which; the reference functions serve every other case (they are the CPU engine path).
Importing this package never initialises CUDA.
"""
from .device import interpreted, triton_available
from .reference import paged_attention_ref, rms_norm_ref, rope_ref, store_kv_cache_ref

try:
    from .attention import paged_attention
    from .kv_store import store_kv_cache
    from .rmsnorm import rms_norm
    from .rotary import rope
except ImportError:  # triton missing: only the references exist
    def _no_triton(*_args, **_kwargs):
        raise RuntimeError("triton is not installed; use kernels.reference")
    paged_attention = store_kv_cache = rms_norm = rope = _no_triton

__all__ = [
    "interpreted", "paged_attention", "paged_attention_ref", "rms_norm", "rms_norm_ref", "rope",
    "rope_ref", "store_kv_cache", "store_kv_cache_ref", "triton_available",
]
