"""Engine options (EngineArgs) and the model's shape read from a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineArgs:
    """Every option here is also a `parameters` entry of model_repository/engine/config.pbtxt."""
    block_size: int = 16
    kv_cache_memory: int = 256 * 1024 * 1024      # bytes for the device KV pool
    num_kv_blocks: int | None = None              # overrides kv_cache_memory when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None              # default: the model's max_position_embeddings
    max_waiting: int = 256                        # bounded waiting queue; past it requests are rejected
    enable_prefix_caching: bool = True
    host_tier_blocks: int = 0                     # offload tier in host memory (0 = off)
    disk_tier_path: str | None = None
    disk_tier_blocks: int = 0
    dtype: str = "float32"                        # float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"                  # auto (= dtype) | fp16 | bf16: the KV pool's element (vLLM's name);
                                                  # half KV halves the bytes attention reads per context token
    quantization: str = "none"                    # none | int8 | int4: weight-only, decoder projections (backend/quant)
    quant_group_size: int = 32                    # inputs per weight scale (int4: a multiple of 32); int8: 0 = one per output channel
    quant_lm_head: bool = False                   # the LM head too (a tied head gets a quantized copy)
    device: str = "cpu"
    attention_backend: str = "auto"               # auto | torch | triton
    seed: int = 0
    num_threads: int | None = None                # torch intra-op threads on CPU
    stream_interval: float = 0.0                  # serving: seconds the response thread gathers a
                                                  # stream's tokens into one response (0 = each step)
    busy_stream_interval: float = 0.05            # serving: while >= 16 requests are open, a stream's tokens
                                                  # that come < this many seconds after its last send go
                                                  # with its next response (fewer responses per token
                                                  # under load; per choice; 0 = off; response_thread.py)
    busy_hold_steps: float = 2.5                  # ... and at least this many of the stream's own gaps between
    busy_hold_max: float = 0.3                    # steps, up to this many seconds (slow steps still gather)
    speculative_config: str | dict | None = None  # vLLM's spelling, JSON text or a dict (backend/spec/config.py)
    # Hardening (issue 19; backend/engine/fairness.py, docs/serving.md "Tenants and trust"):
    max_running_per_tenant: int = 0               # sequences one tenant may run at once (0 = no limit)
    max_waiting_per_tenant: int = 0               # requests one tenant may queue (0 = no limit): queue_full past it
    priority_aging_s: float = 5.0                 # a waiting request gains one priority level per this many s (0 = off)
    allow_client_salt: bool = False               # honour the cache_salt parameter (else the tenant sets the salt)
    shutdown_drain_s: float = 30.0                # on unload, open requests may finish this long, then are cut
    drain_file: str | None = None                 # the launcher writes a drain deadline here (backend/serving/drain_watch.py)
    test_faults: bool = False                     # tests only, and only with TRITON_LLM_TEST_FAULTS=1
    # Prefill/decode disaggregation (issue 21; backend/disagg, docs/disaggregation.md):
    role: str = "unified"                         # unified | prefill | decode
    kv_connector: str = "shm"                     # shm (one host) | tcp
    kv_connector_host: str = "127.0.0.1"          # tcp: where the prefill side serves staged KV
    kv_connector_port: int = 0                    # tcp: 0 = any free port
    kv_staged_ttl_s: float = 60.0                 # prefill: staged KV nobody fetched is dropped after this
    kv_secret_file: str | None = None             # tcp: the pair's shared secret (a 0600 file; serve --disagg
                                                  # makes one per pair); required beyond loopback
    # Multi-LoRA serving (issue 31; backend/lora, docs/lora.md):
    max_loras: int = 0                            # adapters resident at once (LRU of idle ones evicted); 0 = LoRA off
    max_lora_rank: int = 64                       # adapters of a higher rank are refused
    lora_modules: str | dict | None = None        # adapters registered at start: JSON {"name": "dir", ...} (serve --lora)

    def __post_init__(self) -> None:
        from backend.spec.config import SpeculativeConfig
        SpeculativeConfig.parse(self.speculative_config)     # a bad value fails where it is given
        if self.quantization not in ("none", "int8", "int4"):
            raise ValueError(f"quantization must be none, int8 or int4 (got {self.quantization!r})")
        if self.kv_cache_dtype not in ("auto", "fp16", "bf16", "float16", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, fp16 or bf16 (got {self.kv_cache_dtype!r})")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1 (got {self.max_loras}, "
                             f"{self.max_lora_rank})")
        if self.lora_modules and not self.max_loras:
            raise ValueError("lora_modules needs max_loras >= 1 (adapter slots)")
        if self.role not in ("unified", "prefill", "decode"):
            raise ValueError(f"role must be unified, prefill or decode (got {self.role!r})")
        if self.kv_connector not in ("shm", "tcp"):
            raise ValueError(f"kv_connector must be shm or tcp (got {self.kv_connector!r})")
        from common.net import is_loopback
        if (self.role == "prefill" and self.kv_connector == "tcp" and not self.kv_secret_file
                and not is_loopback(self.kv_connector_host)):
            raise ValueError(f"kv_connector_host={self.kv_connector_host} is beyond loopback: give "
                             "kv_secret_file (a 0600 file with the pair's shared secret)")

    @classmethod
    def from_dict(cls, d: dict) -> "EngineArgs":
        """Build from string-valued options (Triton parameters); unknown keys raise ValueError."""
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, raw in d.items():
            if key not in known:
                raise ValueError(f"unknown engine option {key!r}")
            default = known[key].default
            if raw is None or raw == "":
                continue
            if isinstance(default, bool):
                kwargs[key] = str(raw).lower() in ("1", "true", "yes", "on")
            elif isinstance(default, int) or key in ("num_kv_blocks", "max_model_len", "num_threads"):
                kwargs[key] = int(raw)
            elif isinstance(default, float):
                kwargs[key] = float(raw)
            else:
                kwargs[key] = str(raw)
        return cls(**kwargs)
