"""LoRARegistry: the adapters a server knows, and the bounded set of them resident in memory.

    known     name -> directory       (serve --lora NAME=DIR, load_lora_adapter); unbounded, no weights
    resident  name -> LoRAAdapter     at most ``max_loras``; least recently used first

A request resolves its adapter by name: a known adapter that is not resident is loaded, evicting
the least recently used resident adapter that no open request uses (``busy``). A request keeps a
reference to its :class:`LoRAAdapter`, so unloading or evicting an adapter never changes a running
stream. Thread-safe: the serving side loads and unloads while the engine thread resolves.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable

import torch

from backend.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from backend.model.config import ModelConfig

_NAME_MAX = 128


class UnknownAdapter(LookupError):
    """A name no adapter is registered under."""


class LoRARegistry:
    def __init__(self, cfg: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be positive (got {max_loras}, {max_lora_rank})")
        self.cfg, self.max_loras, self.max_lora_rank = cfg, max_loras, max_lora_rank
        self.dtype, self.device = dtype, device
        self._known: dict[str, str] = {}
        self._resident: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0
        self.evictions = 0
        self.loads_by_name: Counter[str] = Counter()       # per adapter, for the metrics (metrics.py)
        self.evictions_by_name: Counter[str] = Counter()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._known)

    def resident(self) -> list[str]:
        """Resident adapters, least recently used first."""
        with self._lock:
            return list(self._resident)

    def _read(self, name: str, path: str) -> LoRAAdapter:
        return load_adapter(name, path, self.cfg, max_rank=self.max_lora_rank, dtype=self.dtype, device=self.device)

    def load(self, name: str, path: str, busy: Iterable[str] = ()) -> LoRAAdapter:
        """Register ``name`` -> ``path`` and make it resident (validated first: a bad adapter
        changes nothing). Raises ValueError for a bad name, LoRAError for a bad adapter or when
        every slot is taken by an adapter in use, or if ``name`` is already loaded."""
        if not isinstance(name, str) or not name or len(name) > _NAME_MAX or name.strip() != name:
            raise ValueError(f"lora_name must be a non-empty string of at most {_NAME_MAX} characters "
                             "without surrounding spaces")
        with self._lock:
            if name in self._known:
                raise LoRAError(f"adapter {name!r} is already loaded (unload it first)")
        adapter = self._read(name, str(path))       # outside the lock: file reads
        with self._lock:
            if name in self._known:
                raise LoRAError(f"adapter {name!r} is already loaded (unload it first)")
            self._make_room(set(busy))
            self._known[name] = str(path)
            self._resident[name] = adapter
            self._count_load(name)
        return adapter

    def unload(self, name: str) -> None:
        """Forget ``name``; requests already holding it finish on it. Raises UnknownAdapter."""
        with self._lock:
            if self._known.pop(name, None) is None:
                raise UnknownAdapter(name)
            self._resident.pop(name, None)

    def resolve(self, name: str, busy: Iterable[str] = ()) -> LoRAAdapter:
        """The resident adapter for ``name`` (marked most recently used), loading it from its
        directory after an eviction. Raises UnknownAdapter, or LoRAError if it cannot be loaded."""
        with self._lock:
            adapter = self._resident.get(name)
            if adapter is not None:
                self._resident.move_to_end(name)
                return adapter
            path = self._known.get(name)
        if path is None:
            raise UnknownAdapter(name)
        adapter = self._read(name, path)
        with self._lock:
            if self._known.get(name) != path:          # unloaded or replaced meanwhile
                raise UnknownAdapter(name)
            if name not in self._resident:
                self._make_room(set(busy))
                self._resident[name] = adapter
                self._count_load(name)
            self._resident.move_to_end(name)
            return self._resident[name]

    def _make_room(self, busy: set[str]) -> None:
        while len(self._resident) >= self.max_loras:
            idle = next((n for n in self._resident if n not in busy), None)
            if idle is None:
                raise LoRAError(f"all {self.max_loras} adapter slots (max_loras) hold adapters in use; "
                                "retry when a request on another adapter ends")
            del self._resident[idle]
            self.evictions += 1
            self.evictions_by_name[idle] += 1

    def _count_load(self, name: str) -> None:
        self.loads += 1
        self.loads_by_name[name] += 1

    def counts(self) -> dict[str, tuple[int, int]]:
        """name -> (loads, evictions) since the start, for every adapter ever loaded."""
        with self._lock:
            return {n: (self.loads_by_name[n], self.evictions_by_name[n]) for n in self.loads_by_name}


def parse_lora_modules(value: str | dict | None) -> dict[str, str]:
    """The engine option ``lora_modules``: JSON text or a dict {name: directory}."""
    import json

    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"lora_modules must be a JSON object {{name: directory}} ({e})") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("lora_modules must be a JSON object {name: directory}")
    return dict(value)


def make_lora_registry(cfg: ModelConfig, args, dtype: torch.dtype, device) -> LoRARegistry | None:
    """The runner's registry when ``max_loras`` > 0, with ``lora_modules`` loaded (every one is
    validated now; past ``max_loras`` the earlier ones are evicted and reload on first use)."""
    if not args.max_loras:
        return None
    reg = LoRARegistry(cfg, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, dtype=dtype, device=device)
    for name, path in parse_lora_modules(args.lora_modules).items():
        reg.load(name, path)
    return reg
