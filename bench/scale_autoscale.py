"""Autoscaling under a load step: 1 client → 16 clients → 1 client against the Ray Serve app with
autoscaling between 1 and 2 TritonReplica replicas (docs/benchmarks.md, "Scale-out: autoscaling").

    python -m bench.scale_autoscale --model build/models/tiny \\
        --out docs/img/scale_autoscale.json --plot docs/img/scale_autoscale.png

Each client loops on chat completions (greedy, ``--max-tokens`` tokens, ignore_eos, distinct
conversations) for as long as its phase wants it; a sampler records every second the primary
deployment's replica states (Ray Serve status), the requests open from the clients and the
completion tokens finished. Ray's autoscaler works on ongoing requests per replica
(``--target`` each), with short delays and look-back for the run. Scale-in drains: the replica
Ray removes gets no new requests and its open ones finish (``graceful_shutdown_s``), so the run
must end with zero failed requests. Exit status 1 when replicas did not go 1 → 2 → 1 or a request
failed. Not part of ``make test`` (minutes; it starts tritonservers).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request

APP = "autoscale"


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


class Load:
    """``want`` clients active (the rest idle); counts open requests, tokens and failures."""

    def __init__(self, base: str, clients: int, max_tokens: int) -> None:
        self.base, self.max_tokens = base, max_tokens
        self.want, self.stop = 0, threading.Event()
        self.lock = threading.Lock()
        self.open = self.done = self.tokens = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        turn = 0
        while not self.stop.is_set():
            if i >= self.want:
                time.sleep(0.1)
                continue
            body = {"model": "bench", "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "system", "content": f"Client {i} of the autoscaling run."},
                                 {"role": "user", "content": f"Request {turn}: count slowly."}]}
            turn += 1
            with self.lock:
                self.open += 1
            try:
                out = _post(self.base, body)
                n = out["usage"]["completion_tokens"]
                with self.lock:
                    self.done += 1
                    self.tokens += n
            except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
                with self.lock:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} client {i}: {exc}")
            finally:
                with self.lock:
                    self.open -= 1


def replica_states(app: str = APP, deployment: str = "TritonReplica") -> dict:
    from ray import serve

    try:
        dep = serve.status().applications[app].deployments[deployment]
        return {str(k).rsplit(".", 1)[-1]: v for k, v in dep.replica_states.items()}
    except (KeyError, AttributeError):
        return {}


def run(a) -> dict:
    import ray
    from ray import serve

    from triton_llm.scale.app import ScaleConfig, build_app
    from backend.serving.process_group import free_port

    opts = dict(o.split("=", 1) for o in a.engine_option)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ScaleConfig(model_dir=a.model, engine_options=opts, autoscale=True, min_replicas=1,
                          max_replicas=2, target_ongoing_requests=a.target, upscale_delay_s=a.upscale_delay,
                          downscale_delay_s=a.downscale_delay, autoscale_look_back_s=a.look_back,
                          autoscale_metrics_interval_s=1.0, replica_cpus=0.5, ingress_cpus=0.25,
                          graceful_shutdown_s=30.0, health_check_period_s=2.0, shim={"model_name": "bench"})
        serve.run(build_app(cfg), name=APP, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        load = Load(base, a.high, a.max_tokens)
        load.start()
        phases = [(a.low, a.low_s), (a.high, a.high_s), (a.low, a.tail_s)]
        timeline, t0 = [], time.monotonic()
        last_tokens, last_t = 0, t0
        for want, seconds in phases:
            load.want = want
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(1.0)
                now = time.monotonic()
                with load.lock:
                    tokens, open_, done, failed = load.tokens, load.open, load.done, len(load.failures)
                states = replica_states()
                timeline.append({"t": round(now - t0, 1), "clients": want, "open_requests": open_,
                                 "running": states.get("RUNNING", 0), "states": states, "done": done,
                                 "failed": failed,
                                 "tok_s": round((tokens - last_tokens) / (now - last_t), 1)})
                last_tokens, last_t = tokens, now
                print(json.dumps(timeline[-1]), flush=True)
        load.want = 0
        load.stop.set()
        for t in load.threads:
            t.join(120)
        running = [p["running"] for p in timeline]
        high_end = next(i for i, p in enumerate(timeline) if p["t"] >= a.low_s + a.high_s) \
            if timeline[-1]["t"] >= a.low_s + a.high_s else len(timeline)
        up = next((p["t"] for p in timeline if p["running"] >= 2), None)
        result = {"command": "python -m bench.scale_autoscale " + " ".join(a.argv),
                  "config": {"target_ongoing_requests": a.target, "upscale_delay_s": a.upscale_delay,
                             "downscale_delay_s": a.downscale_delay, "look_back_period_s": a.look_back,
                             "max_tokens": a.max_tokens, "phases": phases},
                  "requests": load.done, "failed": len(load.failures), "failures": load.failures[:10],
                  "replicas_start": running[0] if running else 0,
                  "replicas_max_in_high": max(running[:high_end] or [0]),
                  "replicas_end": running[-1] if running else 0,
                  "scaled_up_at_s": up,
                  "scaled_down_at_s": next((p["t"] for p in timeline if up is not None and p["t"] > up
                                            and p["running"] == 1 and not p["states"].get("STOPPING")), None),
                  "timeline": timeline}
        serve.delete(APP)
        return result
    finally:
        serve.shutdown()
        ray.shutdown()


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    t = [p["t"] for p in tl]
    fig, axes = plt.subplots(3, 1, figsize=(8, 6.5), sharex=True)
    axes[0].step(t, [p["running"] for p in tl], where="post", label="running")
    axes[0].step(t, [p["running"] + p["states"].get("STARTING", 0) for p in tl], where="post",
                 linestyle=":", label="running + starting")
    axes[0].set_ylim(0, 2.6)
    axes[0].set_ylabel("replicas")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[1].step(t, [p["clients"] for p in tl], where="post", alpha=0.5, label="clients (load step)")
    axes[1].plot(t, [p["open_requests"] for p in tl], color="tab:orange", label="open requests")
    axes[1].set_ylabel("ongoing requests")
    axes[1].legend(loc="upper right", fontsize=8)
    tok = [p["tok_s"] for p in tl]
    smooth = [sum(tok[max(0, i - 4):i + 1]) / len(tok[max(0, i - 4):i + 1]) for i in range(len(tok))]
    axes[2].plot(t, tok, color="tab:green", alpha=0.3, label="per sample")
    axes[2].plot(t, smooth, color="tab:green", label="5-sample mean")
    axes[2].legend(loc="upper right", fontsize=8)
    axes[2].set_ylabel("completion tok/s")
    axes[2].set_xlabel("seconds")
    c = result["config"]
    fig.suptitle(f"Ray Serve autoscaling, tiny model, 1-2 replicas (target {c['target_ongoing_requests']} "
                 f"ongoing/replica); {result['requests']} requests, {result['failed']} failed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--low", type=int, default=1, help="clients before and after the step")
    p.add_argument("--high", type=int, default=16, help="clients during the step")
    p.add_argument("--low-s", type=float, default=20.0)
    p.add_argument("--high-s", type=float, default=150.0,
                   help="long enough for a new replica to start (about a minute on a busy 2-core box)")
    p.add_argument("--tail-s", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--target", type=float, default=4.0, help="target ongoing requests per replica")
    p.add_argument("--upscale-delay", type=float, default=3.0)
    p.add_argument("--downscale-delay", type=float, default=15.0)
    p.add_argument("--look-back", type=float, default=5.0)
    p.add_argument("--engine-option", action="append", default=["num_kv_blocks=256", "block_size=16",
                   "max_num_seqs=32", "max_num_batched_tokens=512", "num_threads=1"])
    p.add_argument("--out", default=None, help="write the result (timeline included) as JSON here")
    p.add_argument("--plot", default=None, help="write the timeline plot (PNG) here")
    p.add_argument("--replot", default=None, metavar="JSON", help="only plot a saved --out result")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    a.argv = argv
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), a.plot)
        return 0
    if not a.model:
        p.error("--model is required")
    result = run(a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)
    summary = {k: v for k, v in result.items() if k not in ("timeline",)}
    print(json.dumps(summary, indent=1))
    ok = (result["failed"] == 0 and result["replicas_start"] == 1 and result["replicas_max_in_high"] == 2
          and result["replicas_end"] == 1)
    print("scaled 1 -> 2 -> 1 with zero failed requests:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
