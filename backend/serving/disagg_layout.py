"""Where the disaggregated pair's threads run (``triton-llm serve --disagg --disagg-cpus``):
``pin_tree`` / ``sched_tree`` set the CPU affinity / scheduling policy and nice value of a process
and every thread of it and of its children (tritonserver, its Python stubs and their torch
threads); ``apply_layout`` places the pair on two CPU sets: the decode engine alone on its CPUs
(docs/disaggregation.md "CPU layout").
"""
from __future__ import annotations

import os


def parse_cpus(spec: str | None) -> tuple[set[int], set[int]] | None:
    """"0:1" / "0-1:2,3" -> ({0}, {1}) / ({0, 1}, {2, 3}); "auto": this process's CPUs halved
    (None with fewer than 2); None / "" / "none" -> None."""
    if not spec or spec == "none":
        return None
    if spec == "auto":
        mine = sorted(os.sched_getaffinity(0))
        if len(mine) < 2:
            return None
        half = len(mine) // 2
        return set(mine[:half]), set(mine[half:])

    def one(part: str) -> set[int]:
        out: set[int] = set()
        for item in part.split(","):
            a, _, b = item.partition("-")
            out.update(range(int(a), int(b or a) + 1))
        return out

    try:
        pre, dec = spec.split(":")
        return one(pre), one(dec)
    except ValueError:
        raise ValueError(f"--disagg-cpus must look like PREFILL:DECODE, e.g. 0:1 (got {spec!r})") from None


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def tree_pids(roots: list[int]):
    """Each live process of ``roots`` and of their descendants, once."""
    todo, seen = list(roots), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        yield p
        try:
            todo += _children(p)
        except OSError:                 # gone meanwhile
            pass


def tree_tids(pid: int, *, include_root: bool = True, descendants: bool = True) -> list[int]:
    """Every thread id of ``pid`` (``include_root``) and of its descendants (``descendants``)."""
    if include_root:
        procs = tree_pids([pid]) if descendants else [pid]
    else:
        procs = tree_pids(_children(pid)) if descendants else []
    out: list[int] = []
    for p in procs:
        try:
            out += [int(t) for t in os.listdir(f"/proc/{p}/task")]
        except OSError:
            continue
    return out


def pin_tree(pid: int, cpus: set[int], *, include_root: bool = True, descendants: bool = True) -> int:
    """Pin every thread of ``pid`` and of its descendants to ``cpus``; returns threads pinned.
    ``include_root=False`` pins only the descendants (tritonserver's Python stubs, where the engine
    runs), leaving tritonserver's own front-end threads free to run on any core;
    ``descendants=False`` only the root's own threads. Threads created later inherit it."""
    n = 0
    for tid in tree_tids(pid, include_root=include_root, descendants=descendants):
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except OSError:
            pass
    return n


def sched_tree(pid: int, *, nice: int = 0, policy: int = os.SCHED_OTHER, include_root: bool = True,
               descendants: bool = True) -> int:
    """Set the scheduling policy (SCHED_OTHER / SCHED_BATCH / SCHED_IDLE) and nice value of every
    thread of the tree (Linux: both are per thread and inherited by new threads). Best effort: a
    negative nice needs CAP_SYS_NICE and is skipped without it. Returns threads changed."""
    n = 0
    for tid in tree_tids(pid, include_root=include_root, descendants=descendants):
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:
            pass
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            n += 1
        except OSError:
            pass
    return n


def pin_named(pid: int, names: tuple[str, ...], cpus: set[int]) -> int:
    """Pin the threads of ``pid``'s descendants whose OS name (comm) is one of ``names``."""
    n = 0
    for tid in tree_tids(pid, include_root=False):
        try:
            with open(f"/proc/{tid}/comm") as f:
                if f.read().strip() not in names:
                    continue
            os.sched_setaffinity(tid, cpus)
            n += 1
        except OSError:
            pass
    return n


# decode-stub threads that do no token-path work and whose work is GIL-free (memcpy, page faults,
# munmap): on the prefill CPUs, so that they never take the decode engine's core
# (backend/disagg/placer.py KVPlacer: a hand-over's fetch + KV write)
OFF_DECODE_THREADS = ("kv-admit",)

PREFILL_NICE = 19            # the prefill engine yields its core at once
TOKEN_PATH_NICE = -10        # the decode server, the prefill front end and ``others``


def apply_layout(pair, cpus: tuple[set[int], set[int]], others: tuple[int, ...] = ()) -> None:
    """Place the pair's processes (``pair``: a DisaggServers) on ``cpus`` = (prefill cpus, decode
    cpus); re-appliable (every thread is first reset to both cpu sets, SCHED_OTHER, nice 0).

    The decode engine (the decode server's Python stubs) runs ALONE on the decode cpus; everything
    else -- both tritonserver front ends, the prefill engine and ``others`` (the shim, a bench
    client) -- on the prefill cpus, the prefill engine at SCHED_BATCH / nice 19 so that the front
    ends, which carry every token to the client, preempt it at once. The token path (decode server,
    prefill front end, ``others``) at nice -10 where allowed (CAP_SYS_NICE), against other jobs on
    the host. The decode stub's hand-over copy thread (``OFF_DECODE_THREADS``) goes to the prefill
    cpus too. Of the placements measured this one had the lowest ITL p99 and p99/p50
    (docs/disaggregation.md "CPU layout").
    """
    pre, dec = cpus
    both = pre | dec
    roots = [s.proc.pid for s in pair.servers] + list(others)
    for pid in roots:
        pin_tree(pid, both)
        sched_tree(pid)
    pin_tree(pair.prefill.proc.pid, pre)
    pin_tree(pair.decode.proc.pid, pre, descendants=False)       # decode front end
    for pid in others:
        pin_tree(pid, pre)
    pin_tree(pair.decode.proc.pid, dec, include_root=False)       # decode engine
    pin_named(pair.decode.proc.pid, OFF_DECODE_THREADS, pre)      # its hand-over KV copies
    sched_tree(pair.decode.proc.pid, nice=TOKEN_PATH_NICE)
    for pid in [pair.prefill.proc.pid, *others]:
        sched_tree(pid, nice=TOKEN_PATH_NICE, descendants=pid != pair.prefill.proc.pid)
    sched_tree(pair.prefill.proc.pid, nice=PREFILL_NICE, include_root=False, policy=os.SCHED_BATCH)
