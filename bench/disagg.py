"""Hand-over cost, in process: per-request hand-over time and bytes moved, plus TTFT and total
time against a unified engine on the same prompts (greedy outputs compared token for token).

    .venv/bin/python -m bench.disagg --preset tiny --connector shm
    .venv/bin/python -m bench.disagg --preset bench-15m --connector tcp

Both engines share this process and its threads, so this measures the hand-over's own cost,
not the ITL benefit of separating the roles (that needs two processes on separate cores).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend.config import EngineConfig
from backend.disagg.pair import DisaggPair
from backend.disagg.shm import SharedMemoryConnector
from backend.disagg.tcp import TcpConnector
from backend.engine.llm_engine import LLMEngine
from backend.engine.admission import SamplingParams


def drive(target, prompts, params) -> tuple[dict, dict, float]:
    t0 = time.perf_counter()
    tokens, ttft = {}, {}
    for i, p in enumerate(prompts):
        target.add_request(f"r{i}", p, params)
    while target.has_unfinished():
        for d in target.step():
            if d.new_token_ids and d.request_id not in ttft:
                ttft[d.request_id] = time.perf_counter() - t0
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return tokens, ttft, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--connector", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    from tests.conftest import model_dir
    path = model_dir(a.preset)
    args = dict(num_kv_blocks=a.requests * (a.prompt_len // 16 + 4), num_threads=a.threads,
                max_num_batched_tokens=2048)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 3000, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, min_tokens=a.max_tokens)
    ref, ref_ttft, ref_s = drive(LLMEngine(path, EngineConfig(**args)), prompts, params)
    if a.connector == "shm":
        conn, dconn = SharedMemoryConnector(), None
    else:
        conn, dconn = TcpConnector(), TcpConnector()
    pair = DisaggPair(LLMEngine(path, EngineConfig(**args)), LLMEngine(path, EngineConfig(**args)), conn, dconn)
    try:
        got, ttft, pair_s = drive(pair, prompts, params)
    finally:
        conn.close()
    st = (dconn or conn).stats()
    ho = sorted(pair.handover_seconds)
    per_req = st.fetched_bytes / max(1, st.fetched)
    print(f"preset={a.preset} connector={a.connector} requests={a.requests} prompt_len={a.prompt_len} "
          f"max_tokens={a.max_tokens} threads={a.threads}")
    print(f"outputs identical to unified: {got == ref}")
    print(f"hand-over ms p50={1e3 * statistics.median(ho):.2f} max={1e3 * ho[-1]:.2f}  "
          f"(stage {1e3 * conn.stats().stage_seconds / max(1, conn.stats().staged):.2f} ms/req, "
          f"fetch {1e3 * st.fetch_seconds / max(1, st.fetched):.2f} ms/req)")
    print(f"bytes moved per request={per_req / 2**20:.2f} MiB  total={st.fetched_bytes / 2**20:.1f} MiB")
    print(f"TTFT p50 ms unified={1e3 * statistics.median(ref_ttft.values()):.1f} "
          f"disagg={1e3 * statistics.median(ttft.values()):.1f}")
    print(f"total s unified={ref_s:.2f} disagg={pair_s:.2f}")


if __name__ == "__main__":
    main()
