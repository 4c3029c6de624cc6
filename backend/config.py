"""Engine options: one dataclass per concern, one flat surface for users.

The parts, each taken by what uses it:
- ``EngineConfig``: the model (dtype, quantization, device, attention), the KV pool and its tiers,
  the scheduler's budget, speculative decoding: LLMEngine, ModelRunner, backend/context.py;
- ``ServingConfig``: the response thread's stream intervals and hold, the drain on unload:
  EngineService (backend/serving/engine_service.py);
- ``TenancyConfig``: per-tenant limits, priority aging, cache salts: TenantFairness and intake;
- ``DisaggConfig``: the role, the KV connector and its secret: backend/serving/disagg_engine.py;
- ``LoRAConfig``: adapter slots and the adapters registered at start: the runner's LoRA registry.

Users see one flat set of options, each a leaf field of one part (names are unique across parts):
``--engine-option KEY=VALUE``, ``LLM(**options)``, and the ``parameters`` of the engine model's
config.pbtxt (strings), which backend/serving/engine_parameters.py generates from these dataclasses
(each part's docstring its heading). ``EngineArgs(**options)`` and ``EngineArgs.from_dict`` route
each to its part.
To add an option: docs/contributing.md.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from common.env import parse_bool


@dataclass
class EngineConfig:
    """The model, the KV pool and its tiers, the scheduler's budget, speculative decoding."""
    block_size: int = 16                          # tokens per KV block (the prefix cache's unit)
    kv_cache_memory: int = 256 * 1024 * 1024      # bytes for the device KV pool
    num_kv_blocks: int | None = None              # overrides kv_cache_memory when set
    max_num_seqs: int = 64                        # sequences running at once
    max_num_batched_tokens: int = 2048            # the step's token budget (prefill chunks + decodes)
    max_model_len: int | None = None              # default: the model's max_position_embeddings
    max_waiting: int = 256                        # bounded waiting queue; past it requests are rejected
    enable_prefix_caching: bool = True            # reuse the KV of identical prompt prefixes (hash-chained full blocks)
    host_tier_blocks: int = 0                     # offload tier in host memory (0 = off)
    disk_tier_path: str | None = None             # folder of the disk KV tier (None = no disk tier)
    disk_tier_blocks: int = 0                     # blocks in the disk KV tier
    dtype: str = "float32"                        # float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"                  # auto (= dtype) | fp16 | bf16: the KV pool's element (vLLM's name);
                                                  # half KV halves the bytes attention reads per context token
    quantization: str = "none"                    # none | int8 | int4: weight-only, decoder projections (backend/quant)
    quant_group_size: int = 32                    # inputs per weight scale (int4: a multiple of 32); int8: 0 = one per output channel
    quant_lm_head: bool | None = None             # the LM head too (a tied head gets a quantized copy); None: with int8
                                                  # (as llama.cpp's Q8_0 files; same agreement with fp32, half the bytes)
    device: str = "cpu"                           # torch device of the model and KV pool (cpu, cuda)
    attention_backend: str = "auto"               # auto | torch | triton
    seed: int = 0                                 # seed of the engine's sampler (a request's own seed wins)
    num_threads: int | None = None                # torch intra-op threads on CPU
    speculative_config: str | dict | None = None  # vLLM's spelling, JSON text or a dict (backend/spec/config.py)

    def __post_init__(self) -> None:
        from backend.spec.config import SpeculativeConfig
        SpeculativeConfig.parse(self.speculative_config)     # a bad value fails where it is given
        if self.quantization not in ("none", "int8", "int4"):
            raise ValueError(f"quantization must be none, int8 or int4 (got {self.quantization!r})")
        if self.kv_cache_dtype not in ("auto", "fp16", "bf16", "float16", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, fp16 or bf16 (got {self.kv_cache_dtype!r})")

    @property
    def head_quantized(self) -> bool:
        """Whether the LM head is quantized: ``quant_lm_head``, or by default with int8 weights."""
        return self.quantization == "int8" if self.quant_lm_head is None else self.quant_lm_head



@dataclass
class ServingConfig:
    """The response thread's stream intervals and hold, the drain on unload."""
    stream_interval: float = 0.0                  # seconds the response thread gathers a stream's tokens
                                                  # into one response (0 = each step)
    busy_stream_interval: float = 0.05            # while >= 16 requests are open, a stream's tokens that come
                                                  # < this many seconds after its last send go with its next
                                                  # response (fewer responses per token under load; per
                                                  # choice; 0 = off; backend/serving/response_thread.py)
    busy_hold_steps: float = 2.5                  # under load: hold a stream's tokens for at least this many
                                                  # of its own gaps between steps
    busy_hold_max: float = 0.3                    # under load: ... up to this many seconds (slow steps still gather)
    shutdown_drain_s: float = 30.0                # on unload, open requests may finish this long, then are cut
    drain_file: str | None = None                 # the launcher writes a drain deadline here (backend/serving/drain_watch.py)


@dataclass
class TenancyConfig:
    """Per-tenant limits, priority aging, cache salts (backend/engine/admission.py, docs/serving.md)."""
    max_running_per_tenant: int = 0               # sequences one tenant may run at once (0 = no limit)
    max_waiting_per_tenant: int = 0               # requests one tenant may queue (0 = no limit): queue_full past it
    priority_aging_s: float = 5.0                 # a waiting request gains one priority level per this many s (0 = off)
    allow_client_salt: bool = False               # honour the cache_salt parameter (else the tenant sets the salt)


@dataclass
class DisaggConfig:
    """Prefill/decode disaggregation, the role and the KV connector (backend/disagg, docs/disaggregation.md)."""
    role: str = "unified"                         # unified | prefill | decode
    kv_connector: str = "shm"                     # shm (one host) | tcp
    kv_connector_host: str = "127.0.0.1"          # tcp: where the prefill side serves staged KV
    kv_connector_port: int = 0                    # tcp: 0 = any free port
    kv_staged_ttl_s: float = 60.0                 # prefill: staged KV nobody fetched is dropped after this
    kv_secret_file: str | None = None             # tcp: the pair's shared secret (a 0600 file; serve --disagg
                                                  # makes one per pair); required beyond loopback

    def __post_init__(self) -> None:
        if self.role not in ("unified", "prefill", "decode"):
            raise ValueError(f"role must be unified, prefill or decode (got {self.role!r})")
        if self.kv_connector not in ("shm", "tcp"):
            raise ValueError(f"kv_connector must be shm or tcp (got {self.kv_connector!r})")
        from common.net import is_loopback
        if (self.role == "prefill" and self.kv_connector == "tcp" and not self.kv_secret_file
                and not is_loopback(self.kv_connector_host)):
            raise ValueError(f"kv_connector_host={self.kv_connector_host} is beyond loopback: give "
                             "kv_secret_file (a 0600 file with the pair's shared secret)")


@dataclass
class LoRAConfig:
    """Multi-LoRA serving, adapter slots and the adapters registered at start (backend/lora, docs/lora.md)."""
    max_loras: int = 0                            # adapters resident at once (LRU of idle ones evicted); 0 = LoRA off
    max_lora_rank: int = 64                       # adapters of a higher rank are refused
    lora_modules: str | dict | None = None        # adapters registered at start: JSON {"name": "dir", ...} (serve --lora)

    def __post_init__(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1 (got {self.max_loras}, "
                             f"{self.max_lora_rank})")
        if self.lora_modules and not self.max_loras:
            raise ValueError("lora_modules needs max_loras >= 1 (adapter slots)")


PARTS: dict[str, type] = {"engine": EngineConfig, "serving": ServingConfig, "tenancy": TenancyConfig,
                          "disagg": DisaggConfig, "lora": LoRAConfig}


@dataclass(init=False)
class EngineArgs:
    """Every option, part by part; built from flat options (``EngineArgs(block_size=8, role="prefill")``)
    or from the parts themselves (``EngineArgs(engine=EngineConfig(...))``)."""
    engine: EngineConfig
    serving: ServingConfig
    tenancy: TenancyConfig
    disagg: DisaggConfig
    lora: LoRAConfig

    def __init__(self, **options: Any) -> None:
        names = option_names()
        unknown = sorted(k for k in options if k not in names and k not in PARTS)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}")
        for part, cls in PARTS.items():
            given = options.get(part)
            mine = {k: v for k, v in options.items() if names.get(k) == part}
            if given is not None and mine:
                raise TypeError(f"give {part} either as a {cls.__name__} or as options, not both")
            setattr(self, part, given if given is not None else cls(**mine))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineArgs:
        """Build from string-valued options (Triton parameters, ``--engine-option``); an unknown key or
        a bad value raises ValueError naming the option; an empty value keeps the default."""
        names, types = option_names(), _option_types()
        kwargs: dict[str, Any] = {}
        for key, raw in d.items():
            if key not in names:
                raise ValueError(f"unknown engine option {key!r}")
            if raw is None or raw == "":
                continue
            kwargs[key] = _parse(key, types[key], raw)
        return cls(**kwargs)

    def options(self) -> dict[str, Any]:
        """The flat options (``EngineArgs(**args.options()) == args``)."""
        return {f.name: getattr(getattr(self, part), f.name)
                for part, cls in PARTS.items() for f in dataclasses.fields(cls)}


def option_names() -> dict[str, str]:
    """Every user-facing option -> the part (EngineArgs attribute) it belongs to."""
    return {f.name: part for part, cls in PARTS.items() for f in dataclasses.fields(cls)}


def _option_types() -> dict[str, Any]:
    return {name: typ for cls in PARTS.values() for name, typ in typing.get_type_hints(cls).items()}


def _parse(name: str, typ: Any, raw: Any) -> Any:
    """One string option -> its field's type (``int | None`` -> int; ``str | dict`` stays text)."""
    kinds = {t for t in (typing.get_args(typ) or (typ,)) if t is not type(None)}
    text = str(raw).strip()
    if bool in kinds:
        return parse_bool(text, name=f"engine option {name}")
    if int in kinds:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"engine option {name} must be an integer (got {raw!r})") from None
    if float in kinds:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"engine option {name} must be a number (got {raw!r})") from None
    return str(raw)

