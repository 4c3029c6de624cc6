"""Which of our source files one streamed chat completion runs code from (docs/architecture.md,
"The files one streamed chat completion touches").

    python -m bench.request_path [MODEL]      # default: the tiny preset; prints one file a line

Starts a stack (tritonserver + shim, ``load.stack.Stack``) on the interpreter of
``bench.lab_venv`` with ``LLM_PATH_TRACE=<dir>``: in every process of it (the Triton stubs
included) ``attach_from_env`` installs a profile function on every thread. Three requests warm the
stack; while ``<dir>/on`` exists each process notes the file of every Python function called,
then writes them to ``<dir>/<process>-<pid>.json``. C code (the fused step) and the ensemble's
config.pbtxt are not seen and are counted by hand in the doc. Background work in the same window
is listed too (the metrics thread's poll), marked by its thread.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

ENV = "LLM_PATH_TRACE"
ROOT = pathlib.Path(__file__).resolve().parents[1]
_on = False
_seen: dict[str, set[str]] = {}


def _profile(frame, event, arg) -> None:
    if _on and event == "call":
        _seen.setdefault(frame.f_code.co_filename, set()).add(threading.current_thread().name)


def _watch(directory: pathlib.Path) -> None:
    global _on
    name = f"{pathlib.Path(sys.argv[0] or 'python').name or 'python'}-{os.getpid()}.json"
    while True:
        time.sleep(0.05)
        want = (directory / "on").exists()
        if want and not _on:
            _seen.clear()
            _on = True
        elif _on and not want:
            _on = False
            (directory / name).write_text(json.dumps({f: sorted(t) for f, t in list(_seen.items())}))


def attach_from_env() -> None:
    """Profile every thread of this process when ``LLM_PATH_TRACE`` names a directory."""
    if os.environ.get(ENV):
        sys.setprofile(_profile)
        threading.setprofile(_profile)
        threading.Thread(target=_watch, args=(pathlib.Path(os.environ[ENV]),), name="path-trace", daemon=True).start()


def ours(traces: list[dict[str, list[str]]], repository: str = "/model_repository/") -> dict[str, set[str]]:
    """Our files (relative to the checkout; a model.py from its rendered repository) -> threads."""
    out: dict[str, set[str]] = {}
    for trace in traces:
        for path, threads in trace.items():
            if path.startswith(str(ROOT) + "/") and "/.venv/" not in path and "/build/" not in path:
                key = path[len(str(ROOT)) + 1:]
            elif repository in path and path.endswith("/1/model.py"):
                key = "model_repository/" + path.split(repository, 1)[1]
            else:
                continue
            out.setdefault(key, set()).update(threads)
    return out


_STACK = """
import json, sys
from load.stack import Stack, engine_options, resolve_model
with Stack(resolve_model(sys.argv[1]), engine_options(sys.argv[1], []), shim=True) as st:
    print(json.dumps({"shim_url": st.shim_url}), flush=True)
    sys.stdin.read()
"""


def run(model: str = "tiny") -> dict[str, set[str]]:
    import httpx

    from bench.lab_venv import lab_venv

    directory = pathlib.Path(tempfile.mkdtemp(prefix="path-trace-"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {ENV: str(directory)}
    proc = subprocess.Popen([str(lab_venv()), "-c", _STACK, model], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith('{"shim_url"'):
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the stack did not start")
        url = json.loads(line)["shim_url"]
        name = httpx.get(url + "/models", timeout=60).json()["data"][0]["id"]
        body = {"model": name, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "stream": True}

        def one() -> None:
            with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as r:
                assert r.status_code == 200 and list(r.iter_lines())
        for _ in range(3):
            one()
        (directory / "on").touch()
        time.sleep(0.5)                 # every process saw "on" (they poll every 50 ms)
        one()
        time.sleep(1.0)                 # the response thread's and the engine's last work
        (directory / "on").unlink()
        time.sleep(1.0)
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
    return ours([json.loads(p.read_text()) for p in directory.glob("*.json")])


if __name__ == "__main__":
    files = run(*sys.argv[1:2])
    for path in sorted(files):
        print(f"{path:50s} {', '.join(sorted(files[path]))}")
    print(f"{len(files)} files")
