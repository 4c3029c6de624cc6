"""Wall time of one fused CPU step per thread setting, side by side: 1 thread, 2 threads on the
step's worker pool, 2 threads on OpenMP regions (``step_pool_set``), alternating repetitions; quiet
and with a busy core imitated (a second process burning ``--burn-ms`` of every ``2 * burn-ms``,
like the serving stack's bursts). Run with ``OMP_WAIT_POLICY=PASSIVE`` for the stub's OpenMP setting.

    OMP_WAIT_POLICY=PASSIVE python -m bench.model_threads build/models/bench-15m build/models/bench-110m
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time

import torch

from backend.config import EngineConfig
from backend.model.runner import SeqChunk, build_batch
from backend.model.runner import ModelRunner
from kernels.cpu import decode_library

BS = 16
MODES = (("1 thread", 1, 1), ("2 threads, pool", 2, 1), ("2 threads, OpenMP", 2, 0))


def _burn(stop, seconds: float) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass
        time.sleep(seconds)


def run(model: str, reps: int, batch_size: int, burn_ms: float) -> None:
    r = ModelRunner(model, EngineConfig(block_size=BS, num_kv_blocks=2048, num_threads=2))
    rng = random.Random(0)
    blocks = rng.sample(range(2048), 2048)
    chunks = []
    for _ in range(batch_size):
        n = rng.randrange(100, 200)
        nb = -(-(n + 1) // BS)
        chunks.append(SeqChunk([rng.randrange(1000)], n, blocks[:nb]))
        blocks = blocks[nb:]
    batch = build_batch(chunks, BS)
    lib = decode_library()
    saved = torch.get_num_threads()
    try:
        for busy in (False, True):
            stop, proc = mp.Event(), None
            if busy:
                proc = mp.Process(target=_burn, args=(stop, burn_ms / 1e3))
                proc.start()
            times: dict[str, list[float]] = {name: [] for name, _, _ in MODES}
            for _ in range(reps):
                for name, nt, pool in MODES:
                    lib.step_pool_set(pool)
                    torch.set_num_threads(nt)
                    t = time.perf_counter()
                    r.execute(batch)
                    times[name].append(time.perf_counter() - t)
            if proc is not None:
                stop.set()
                proc.join()
            cells = ", ".join(f"{n} {statistics.median(v) * 1e3:.1f} ms" for n, v in times.items())
            print(f"{model} {batch_size} decodes, {'busy core' if busy else 'quiet'}: {cells}", flush=True)
    finally:
        lib.step_pool_set(1)
        torch.set_num_threads(saved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--burn-ms", type=float, default=3.0)
    a = p.parse_args()
    for m in a.models:
        run(m, a.reps, a.batch, a.burn_ms)


if __name__ == "__main__":
    main()
