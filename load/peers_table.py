"""The peers suite's report: the host's CPU, one table per model, best dtype against best dtype.

Results (``load.peers.run_peers``)::

    {"machine": {...}, "settings": {...},
     model: {dtype: {"llama.cpp" | "vLLM CPU" | "ours": {streams: bench_point result}, "weights": {...}}}}

Each side's best row takes, per model and stream count, its fastest dtype (output tok/s); the
ratio is ours over the better of the peers.
"""
from __future__ import annotations

import subprocess

PEER, VLLM, OURS = "llama.cpp", "vLLM CPU", "ours"
CONTENDERS = (PEER, VLLM, OURS)
# The flags that decide which kernels each server can use on this host.
ISA = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8", "q8_0": "q8_0", "q4_0": "q4_0"}


def parse_lscpu(text: str) -> dict:
    """``lscpu``'s model name, family / model and the flags in ISA."""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
    flags = set(fields.get("Flags", "").split())
    return {"cpu": fields.get("Model name", "?"), "family": fields.get("CPU family", "?"),
            "model": fields.get("Model", "?"), "isa": [f for f in ISA if f in flags]}


def lscpu() -> dict:
    try:
        return parse_lscpu(subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout)
    except (OSError, subprocess.SubprocessError):
        return parse_lscpu("")


def host_line(m: dict) -> str:
    isa = m.get("isa", [])
    missing = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f not in isa]
    return (f"Host: {m.get('cpu', '?')} (family {m.get('family', '?')} model {m.get('model', '?')}), "
            f"{m.get('cores', '?')} cores; flags: {' '.join(isa) or 'none of ' + ' '.join(ISA)}"
            + (f"; no {', no '.join(missing)}" if missing else "") + f"; load {_load(m)}")


def _load(m: dict) -> str:
    a, b = m.get("loadavg"), m.get("loadavg_end")
    return "–" if a is None else f"{a[0]:.1f}" + ("" if b is None else f" → {b[0]:.1f}")


def _summary(res: dict, who: str, s: int) -> dict | None:
    """The point's summary; stream counts are ints in memory and strings in the saved JSON."""
    points = res.get(who) or {}
    run = points.get(s, points.get(str(s)))
    return None if run is None else run["summary"]


def _tok(res: dict, who: str, s: int) -> float | None:
    summary = _summary(res, who, s)
    return None if summary is None else summary["output_throughput"]


def _p50(res: dict, who: str, s: int, key: str, spec: str) -> str:
    summary = _summary(res, who, s)
    if summary is None:
        return "–"
    x = summary[key]
    return format(x["p50"] if isinstance(x, dict) else x, spec)


def _f(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def ratio(ours: float | None, peers: list[float | None]) -> float | None:
    """Ours over the better peer (None when either side is missing)."""
    known = [p for p in peers if p]
    return ours / max(known) if ours is not None and known else None


def best(by_dtype: dict, who: str, s: int) -> tuple[float | None, str]:
    """``who``'s fastest (tok/s, dtype) at ``s`` streams among the dtypes it ran."""
    runs = [(t, d) for d, res in by_dtype.items() if (t := _tok(res, who, s)) is not None]
    return max(runs) if runs else (None, "–")


def streams_of(by_dtype: dict) -> list[int]:
    seen: dict[int, None] = {}
    for res in by_dtype.values():
        for who in CONTENDERS:
            for s in res.get(who) or {}:
                seen[int(s)] = None
    return sorted(seen, reverse=True)


def model_table(model: str, by_dtype: dict, header: str) -> str:
    rows = []
    for dtype, res in by_dtype.items():
        for s in streams_of({dtype: res}):
            toks = {who: _tok(res, who, s) for who in CONTENDERS}
            r = ratio(toks[OURS], [toks[PEER], toks[VLLM]])
            rows.append(f"| {SHORT.get(dtype, dtype)} | {s} | " + " | ".join(_f(toks[w]) for w in CONTENDERS)
                        + f" | {_f(r, '.2f') + 'x' if r is not None else '–'} | "
                        + " / ".join(_p50(res, w, s, "ttft_ms", ".0f") for w in CONTENDERS) + " | "
                        + " / ".join(_p50(res, w, s, "itl_ms", ".1f") for w in CONTENDERS) + " |")
    for s in streams_of(by_dtype):
        b = {who: best(by_dtype, who, s) for who in CONTENDERS}
        r = ratio(b[OURS][0], [b[PEER][0], b[VLLM][0]])
        cells = [f"{_f(b[w][0])} ({SHORT.get(b[w][1], b[w][1])})" if b[w][0] is not None else "–"
                 for w in CONTENDERS]
        rows.append(f"| **best dtype** | {s} | " + " | ".join(cells)
                    + f" | {f'**{r:.2f}x**' if r is not None else '–'} | | |")
    return "\n".join([f"**{model}**: {header}", "",
                      f"| dtype | streams | {PEER} tok/s | {VLLM} tok/s | ours tok/s | ours / better peer "
                      f"| TTFT p50 ms {PEER} / vLLM / ours | ITL p50 ms {PEER} / vLLM / ours |",
                      "|---|---|---|---|---|---|---|---|", *rows])


def settings_header(st: dict) -> str:
    """What a reader needs to trust a row: request counts and each server's thread setting."""
    req = {int(s): n for s, n in st["requests"].items()}
    counts = ", ".join(f"{s} stream{'s' if s > 1 else ''}: {n} requests" for s, n in req.items())
    why = " (sized down from 64 to fit the run)" if any(n < 64 for n in req.values()) else ""
    t = st["threads"]
    label = "one thread each" if t == 1 else f"all {t} cores each"
    return (f"output tok/s; {counts}{why}; {label} (llama-server -t {st['peer_threads']} -tb "
            f"{st['peer_threads']} -np {st['parallel']}, vLLM VLLM_CPU_OMP_THREADS_BIND={st['vllm_bind']}, "
            f"ours {st['ours_threads']}); int8 = llama.cpp Q8_0 / ours int8, vLLM has none here")


def peers_report(out: dict) -> str:
    st = out.get("settings") or {}
    parts = [host_line(out.get("machine", {}))]
    for model, by_dtype in out.items():
        if model in ("machine", "settings"):
            continue
        parts.append(model_table(model, by_dtype, settings_header(st) if st else "output tok/s"))
    return "\n\n".join(parts)
