"""Where a decode token's latency goes (issue 21, ITL p99): an opt-in trace of the decode engine,
joined with the client's arrival times.

With ``LLM_DISAGG_TRACE=<dir>`` in a decode server's environment, ``DecodeEngine`` records per
step (time.monotonic(), one clock for every process of the host):

    t0  step start (engine thread)        ta  hand-overs admitted        t1  deltas ready
    run running sequences before the step  adm records admitted         tok [[request id, tokens], ...]

and every Python GC collection of that process (generation, duration, when). A daemon thread
appends them as JSON lines to ``<dir>/decode-<pid>.jsonl`` about once a second. The bench client
(backend/disagg/bench_stack.py ``--trace``) writes its own arrivals (``client.jsonl``: request id,
tokens, arrival); ``report(dir)`` joins the two on (request id, token index) and splits each
token's inter-token latency into the engine's (its step cadence) and the delivery path's
(response thread, tritonserver, gRPC, client):

    .venv/bin/python -m backend.disagg.trace /tmp/disagg-trace

Off by default (no cost but one attribute test per step).
"""
from __future__ import annotations

import collections
import gc
import json
import os
import pathlib
import sys
import threading
import time

ENV = "LLM_DISAGG_TRACE"


class StepTrace:
    """Buffered step and GC records of one process, flushed by a daemon thread."""

    def __init__(self, directory: str | os.PathLike, name: str = "decode", every: float = 1.0) -> None:
        self.path = pathlib.Path(directory) / f"{name}-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._buf: collections.deque = collections.deque()   # append / popleft are atomic: no lock
        self._gc_start = 0.0
        self._next_check = 0.0
        self._control_mtime = None
        self.sends: collections.deque = collections.deque()     # see time_sends()
        gc.callbacks.append(self._on_gc)
        self._stop = threading.Event()
        self._every = every
        threading.Thread(target=self._run, name="disagg-trace", daemon=True).start()

    @classmethod
    def from_env(cls, name: str = "decode") -> "StepTrace | None":
        d = os.environ.get(ENV)
        return cls(d, name) if d else None

    def control(self) -> dict | None:
        """Bench A/B knobs: the content of ``<dir>/control.json`` when it changed since the last
        call (checked at most every 0.2 s), else None. Only a traced engine reads it."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + 0.2
        path = self.path.parent / "control.json"
        try:
            st = path.stat().st_mtime_ns
            if st == self._control_mtime:
                return None
            self._control_mtime = st
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def step(self, t0: float, ta: float, t1: float, running: int, admitted: int, deltas) -> None:
        tok = [[d.request_id, len(d.new_token_ids)] for d in deltas if d.new_token_ids]
        rec = {"k": "step", "t0": t0, "ta": ta, "t1": t1, "run": running, "adm": admitted, "tok": tok}
        self._buf.append(rec)
        sends = self.sends
        while sends:                        # the response path's send wall times (response_thread.py)
            t, dur = sends.popleft()
            self._buf.append({"k": "send", "t": t, "dur": dur})

    def time_sends(self) -> None:
        """Record the wall time of every response send of this process (the response thread's or
        its senders'), flushed with the steps."""
        from backend.serving import response_thread

        self.sends = response_thread.SEND_TIMES = collections.deque()

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.monotonic()
        if phase == "start":
            self._gc_start = now
            return
        rec = {"k": "gc", "t": self._gc_start, "dur": now - self._gc_start, "gen": info.get("generation"),
               "thread": threading.current_thread().name}
        self._buf.append(rec)               # no lock: a GC may run inside any allocation

    def flush(self) -> None:
        buf = []
        while self._buf:
            buf.append(self._buf.popleft())
        if buf:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in buf))

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.flush()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass
        self.flush()


# -- analysis ---------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _load(path: pathlib.Path) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass                          # a line cut by a kill
    return out


def _per_token(events: list[tuple[str, int, float]]) -> dict[tuple[str, int], float]:
    """(request id, tokens, time) in time order -> (request id, token index) -> time."""
    seen: dict[str, int] = {}
    out = {}
    for rid, n, t in events:
        k = seen.get(rid, 0)
        for i in range(n):
            out[(rid, k + i)] = t
        seen[rid] = k + n
    return out


def _itl(tokens: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """Per token (index >= 1): the gap to the previous token's time, spread evenly over the
    tokens that arrived together (as bench_stack measures ITL)."""
    out = {}
    by_rid: dict[str, list[tuple[int, float]]] = {}
    for (rid, i), t in tokens.items():
        by_rid.setdefault(rid, []).append((i, t))
    for rid, xs in by_rid.items():
        xs.sort()
        j = 0
        while j < len(xs):
            k = j
            while k + 1 < len(xs) and xs[k + 1][1] == xs[j][1]:
                k += 1                        # tokens that arrived together
            if j > 0:
                gap = (xs[j][1] - xs[j - 1][1]) / (k - j + 1)
                for m in range(j, k + 1):
                    out[(rid, xs[m][0])] = gap
            j = k + 1
    return out


def _by_running(steps: list[dict]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in steps:
        out.setdefault(r["run"], []).append(r["t1"] - r["ta"])
    return out


def report(directory: str | os.PathLike, window: tuple[float, float] | None = None,
           prefix: str = "") -> dict:
    """Join the decode traces and the client arrivals of ``directory``; print and return the split.
    ``window`` = (t_from, t_to) monotonic: only tokens the client received in it. ``prefix``: only
    request ids starting with it (the steady streams of the bench: ``s``)."""
    d = pathlib.Path(directory)
    steps, gcs, sends = [], [], []
    for p in sorted(d.glob("decode-*.jsonl")):
        for r in _load(p):
            (steps if r["k"] == "step" else sends if r["k"] == "send" else gcs).append(r)
    client = [r for p in sorted(d.glob("client-*.jsonl")) for r in _load(p)]
    steps.sort(key=lambda r: r["t1"])
    client.sort(key=lambda r: r["t"])
    lo, hi = window or (float("-inf"), float("inf"))
    eng = _per_token([(rid, n, r["t1"]) for r in steps for rid, n in r["tok"] if rid.startswith(prefix)])
    cli = _per_token([(r["rid"], r["n"], r["t"]) for r in client if r["rid"].startswith(prefix)])
    e_itl, c_itl = _itl(eng), _itl(cli)
    keys = [k for k in c_itl if k in e_itl and lo <= cli[k] < hi]
    lat = [cli[k] - eng[k] for k in cli if k in eng and lo <= cli[k] < hi]
    sel = [r for r in steps if lo <= r["t1"] < hi]
    dur = [r["t1"] - r["ta"] for r in sel]
    admit = [r["ta"] - r["t0"] for r in sel if r["adm"]]
    gaps = [b["t0"] - a["t1"] for a, b in zip(sel, sel[1:])]
    cadence = [b["t1"] - a["t1"] for a, b in zip(sel, sel[1:]) if a["tok"] and b["tok"]]
    gsel = [g for g in gcs if lo <= g["t"] < hi]
    send_wall = [x["dur"] for x in sends if lo <= x["t"] < hi]
    cgc = [r for p in sorted(d.glob("clientgc-*.jsonl")) for r in _load(p) if r["k"] == "gc" and lo <= r["t"] < hi]
    ce = [c_itl[k] for k in keys]
    ee = [e_itl[k] for k in keys]
    # per step: when its first and its last stream token reached the client (the sends of one step
    # leave one after another from the response thread)
    by_step: dict[float, list[float]] = {}
    for k, t in cli.items():
        if k in eng and lo <= t < hi:
            by_step.setdefault(eng[k], []).append(t - eng[k])
    full = max((len(v) for v in by_step.values()), default=0)
    firsts = [min(v) for v in by_step.values() if len(v) >= max(1, full // 2)]
    lasts = [max(v) for v in by_step.values() if len(v) >= max(1, full // 2)]
    # the client's p99 tokens: what the engine and the delivery path did for each
    cut = pct(ce, 0.99)
    tail = [k for k in keys if c_itl[k] >= cut]
    tail_eng = [e_itl[k] for k in tail]
    # ... and their split (run P): client ITL of token k = its engine ITL + (delivery lag of k - of
    # k-1), the lag being the step's first-token lag + the token's position within its step's sends
    first_of = {te: min(v) for te, v in by_step.items()}
    split = [(c_itl[k], e_itl[k], (cli[k] - eng[k]) - (cli[p] - eng[p]),
              first_of.get(eng[k], 0.0) - first_of.get(eng[p], 0.0))
             for k in tail for p in [(k[0], k[1] - 1)] if p in eng and p in cli]
    mean = lambda i: sum(x[i] for x in split) / len(split) if split else float("nan")   # noqa: E731
    out = {
        "tokens": len(keys),
        "client_itl_p50": pct(ce, 0.5), "client_itl_p99": pct(ce, 0.99),
        "engine_itl_p50": pct(ee, 0.5), "engine_itl_p99": pct(ee, 0.99),
        "delivery_p50": pct(lat, 0.5), "delivery_p99": pct(lat, 0.99), "delivery_max": max(lat, default=float("nan")),
        "first_p50": pct(firsts, 0.5), "first_p99": pct(firsts, 0.99),
        "last_p50": pct(lasts, 0.5), "last_p99": pct(lasts, 0.99),
        "step_p50": pct(dur, 0.5), "step_p99": pct(dur, 0.99), "step_max": max(dur, default=float("nan")),
        "cadence_p50": pct(cadence, 0.5), "cadence_p99": pct(cadence, 0.99),
        "between_steps_p50": pct(gaps, 0.5), "between_steps_p99": pct(gaps, 0.99),
        "admit_p50": pct(admit, 0.5), "admit_max": max(admit, default=float("nan")), "admit_steps": len(admit),
        "steps": len(sel),
        "sends": len(send_wall), "send_p50": pct(send_wall, 0.5), "send_p99": pct(send_wall, 0.99),
        "step_by_running": {n: (len(v), pct(v, 0.5)) for n, v in sorted(_by_running(sel).items()) if len(v) >= 20},
        "gc": {g: (sum(1 for x in gsel if x["gen"] == g), 1e3 * max((x["dur"] for x in gsel if x["gen"] == g),
                                                                   default=0.0)) for g in (0, 1, 2)},
        "client_gc": {g: (sum(1 for x in cgc if x["gen"] == g), 1e3 * max((x["dur"] for x in cgc if x["gen"] == g),
                                                                        default=0.0)) for g in (0, 1, 2)},
        "tail_tokens": len(tail),
        "tail_engine_itl_p50": pct(tail_eng, 0.5),
        "tail_with_slow_engine": sum(1 for x in tail_eng if x >= cut * 0.75),
        "tail_mean_client_itl": mean(0), "tail_mean_engine_itl": mean(1), "tail_mean_delivery_diff": mean(2),
        "tail_mean_first_lag_diff": mean(3), "tail_mean_position_diff": mean(2) - mean(3),
    }
    return out


def format_report(r: dict) -> str:
    ms = lambda k: f"{1e3 * r[k]:.2f}"   # noqa: E731
    gc_s = ", ".join(f"gen{g}: {n} (max {m:.1f} ms)" for g, (n, m) in r["gc"].items())
    cgc_s = ", ".join(f"gen{g}: {n} (max {m:.1f} ms)" for g, (n, m) in r.get("client_gc", {}).items())
    return (f"tokens {r['tokens']}  steps {r['steps']}\n"
            f"ITL at the client   p50 {ms('client_itl_p50')} ms  p99 {ms('client_itl_p99')} ms\n"
            f"ITL at the engine   p50 {ms('engine_itl_p50')} ms  p99 {ms('engine_itl_p99')} ms  "
            f"(same tokens; the time each left its step)\n"
            f"delivery (engine -> client)  p50 {ms('delivery_p50')} ms  p99 {ms('delivery_p99')} ms  "
            f"max {ms('delivery_max')} ms; a step's first token p50 {ms('first_p50')} p99 {ms('first_p99')} ms, "
            f"its last p50 {ms('last_p50')} p99 {ms('last_p99')} ms\n"
            f"step (model + update)  p50 {ms('step_p50')} ms  p99 {ms('step_p99')} ms  max {ms('step_max')} ms; "
            f"cadence p50 {ms('cadence_p50')} p99 {ms('cadence_p99')} ms; "
            f"between steps p50 {ms('between_steps_p50')} p99 {ms('between_steps_p99')} ms\n"
            + (f"send (one response's IPC, wall)  {r['sends']} sends, p50 {ms('send_p50')} ms, p99 "
               f"{ms('send_p99')} ms\n" if r.get("sends") else "")
            + f"admission (on the step thread)  {r['admit_steps']} steps, p50 {ms('admit_p50')} ms, "
            f"max {ms('admit_max')} ms\n"
            f"step p50 by running sequences: "
            + ", ".join(f"{n}: {1e3 * t:.1f} ms ({c})" for n, (c, t) in r["step_by_running"].items()) + "\n"
            f"GC in the decode process: {gc_s}\n"
            f"GC in the client process: {cgc_s}\n"
            f"the client's p99 tokens: {r['tail_tokens']}, of which {r['tail_with_slow_engine']} had an engine "
            f"ITL >= 0.75 x the client p99 (engine ITL p50 of those {ms('tail_engine_itl_p50')} ms)\n"
            f"those tokens on average: client ITL {ms('tail_mean_client_itl')} = engine ITL "
            f"{ms('tail_mean_engine_itl')} + delivery diff {ms('tail_mean_delivery_diff')} ms (the step's first-token "
            f"lag {ms('tail_mean_first_lag_diff')} + the token's position in its step's sends "
            f"{ms('tail_mean_position_diff')})")


if __name__ == "__main__":
    args = sys.argv[1:]
    pre = ""
    if args and args[0].startswith("--prefix="):
        pre = args.pop(0).split("=", 1)[1]
    print(format_report(report(args[0] if args else "/tmp/disagg-trace", prefix=pre)))
