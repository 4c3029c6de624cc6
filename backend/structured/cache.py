"""ByteLRU: the compiled-grammar cache, bounded by the bytes its entries hold.

A compiled grammar keeps a token mask per grammar position: from kilobytes (a small schema) to
several MB (a regex with long bounded repetitions on a 49k vocabulary), so a bound by count says
nothing about memory. Each entry is charged its ``nbytes`` (xgrammar's ``memory_size_bytes`` plus
the key's text); the least recently used entries go until the total fits ``max_bytes``. An entry
bigger than ``max_bytes`` on its own is not kept (its request still uses it). Thread-safe: the
compile worker inserts, request threads look up, each under a short lock that no compile holds.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable


class ByteLRU:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> bool:
        """Keep ``value`` (evicting the oldest entries to fit); False when it is too big to keep."""
        nbytes = max(0, int(nbytes))
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if nbytes > self.max_bytes:
                return False
            self._items[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self.bytes -= size
            return True

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items
