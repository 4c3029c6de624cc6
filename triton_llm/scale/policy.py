"""Prefix-affinity replica choice, bounded by load. Pure Python: no Ray, no clock.

A request is described by its *prefix chain*: the hashes of the leading full KV blocks of its
rendered prompt (prefix_key.py), each naming a block and everything before it. The policy remembers
which replicas were sent which chains (an LRU table hash -> replicas) and picks:

    1. among replicas whose load is within ``imbalance`` of the least loaded one, the one holding
       the longest prefix of the chain ("prefix"); ties go to the lower load, then the name;
    2. if the longest holder is over that bound, the least loaded replica ("load_bound"): a hot
       prefix spreads to a second replica instead of queueing on one;
    3. with no holder at all, a replica by rendezvous hash of the chain's ``min_blocks``-th block
       (its last, if shorter) among the least loaded ones ("new"), so requests that share a system
       prompt of that many blocks converge even when they are the first of their kind; no chain
       (a prompt shorter than one block) is "least_loaded".
A match shorter than ``min_blocks`` (and than the chain) does not count as a holder: with a chat
template whose opening tokens fill a whole block, every conversation matches that one block, and
following it put every new conversation on one replica (48 of 48 requests of the 12 x 4 workload
with the load never reaching the bound); saving one block of prefill is not worth that.

The table only approximates what each engine really caches (an engine evicts under pressure); a
wrong guess costs one prefill, never a wrong answer, because the engine verifies every hit itself.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("prefix", "load_bound", "new", "least_loaded")


@dataclass(frozen=True)
class Decision:
    replica: str
    policy: str              # one of POLICIES
    matched_blocks: int      # leading blocks the chosen replica is believed to hold


class PrefixAffinityPolicy:
    def __init__(self, *, imbalance: int = 4, max_entries: int = 200_000, min_blocks: int = 2) -> None:
        if imbalance < 0:
            raise ValueError("imbalance must be >= 0")
        if min_blocks < 1:
            raise ValueError("min_blocks must be >= 1")
        self.min_blocks = min_blocks          # shortest match (in blocks) worth following
        self.imbalance = imbalance            # ongoing requests above the least loaded still "ok"
        self.max_entries = max_entries        # bounds the table's memory: LRU over block hashes
        self._holders: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()

    # -- choosing --------------------------------------------------------------------------------
    def choose(self, chain: list[str], loads: dict[str, int]) -> Decision:
        """The replica for a request with prefix ``chain`` given each candidate's ongoing load."""
        if not loads:
            raise ValueError("no replicas to choose from")
        floor = min(loads.values())
        ok = {r for r, n in loads.items() if n <= floor + self.imbalance}
        least = sorted((r for r, n in loads.items() if n == floor))
        if not chain:
            return Decision(least[0], "least_loaded", 0)
        need = min(self.min_blocks, len(chain))
        key = chain[need - 1]                 # a conversation's own block once it has min_blocks
        depth, holders = self._longest_holders(chain, set(loads))
        if holders and depth >= need:
            fit = [r for r in holders if r in ok]
            if fit:
                best = min(fit, key=lambda r: (loads[r], r))
                return Decision(best, "prefix", depth)
            return Decision(self._rendezvous(key, least), "load_bound", 0)
        return Decision(self._rendezvous(key, least), "new", 0)

    def _longest_holders(self, chain: list[str], alive: set[str]) -> tuple[int, list[str]]:
        for i in range(len(chain) - 1, -1, -1):          # longest first: a hash names its prefix
            held = self._holders.get(chain[i])
            if held:
                live = [r for r in held if r in alive]
                if live:
                    return i + 1, live
        return 0, []

    @staticmethod
    def _rendezvous(key: str, replicas: list[str]) -> str:
        return max(replicas, key=lambda r: hashlib.blake2b(f"{key}|{r}".encode(), digest_size=8).digest())

    # -- learning --------------------------------------------------------------------------------
    def record(self, chain: list[str], replica: str) -> None:
        """``replica`` was sent this chain: it will hold these blocks (until it evicts them)."""
        for h in chain:
            held = self._holders.get(h)
            if held is None:
                held = self._holders[h] = OrderedDict()
            else:
                self._holders.move_to_end(h)
            held[replica] = None
            held.move_to_end(replica)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica died or left: its cache is gone (a replacement starts cold)."""
        for h in [h for h, held in self._holders.items() if replica in held]:
            held = self._holders[h]
            del held[replica]
            if not held:
                del self._holders[h]

    def __len__(self) -> int:
        return len(self._holders)
