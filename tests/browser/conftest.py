"""The real stack for the chat page: tritonserver (tiny model) + the OpenAI shim + headless Chromium.

    def test_x(chat_stack, chat_page):      # chat_stack.base_url, .keys, .abort_count(), .metrics()
        chat_page.goto(chat_stack.base_url)

``real_chat_stack`` is the same on the default model (SmolLM2-135M-Instruct), for tests where the
words matter.

Chromium is Debian's (`scripts/install_browser.sh` installs it when missing; the tests skip, saying
why, only when that fails). Development only: ``TRITON_LLM_CHAT_FAKE=1`` serves the shim in-process
on the scripted FakeLLMClient instead of Triton (no real engine behind it; never the default).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "build" / "test-output"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Keys of the shim under test: KEY:TENANT. Each "cold" key is its own tenant, so its prefix cache
# is salted apart from everyone else's (a cold cache for the same prompt).
# Every test uses its own tenants, so tests see only their own conversations in any order.
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "cold1": "sk-cold1", "cold2": "sk-cold2",
        "cold3": "sk-cold3", "carol": "sk-carol", "dave": "sk-dave"}
FAKE = os.environ.get("TRITON_LLM_CHAT_FAKE") == "1"


def _get(url: str, timeout: float = 15.0) -> str:       # generous: a loaded 2-core CI host
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


ABORT_COUNTER = "llm_requests_aborted_total"     # the engine's counter (backend/serving/metrics.py)


def abort_total(metrics_text: str) -> float:
    """The engine's abort counter on Triton's metrics endpoint, summed over its label sets."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(ABORT_COUNTER) and line[len(ABORT_COUNTER)] in "{ ":
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{ABORT_COUNTER} is not on the metrics endpoint"
    return total


class Stack:
    def __init__(self, base_url: str, model_dir: pathlib.Path, metrics_url: str | None,
                 fake=None):
        self.base_url = base_url
        self.model_dir = model_dir
        self.metrics_url = metrics_url
        self.keys = KEYS
        self.fake = fake

    def metrics(self) -> str:
        return _get(self.metrics_url) if self.metrics_url else ""

    def abort_count(self) -> float:
        if self.fake is not None:
            return float(len(self.fake.aborted))
        return abort_total(self.metrics())


def _wait_http(url: str, proc: subprocess.Popen | None, log: pathlib.Path, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the shim exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            _get(url)
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the shim did not answer {url} in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def _shim_stack(triton, model_dir: pathlib.Path, work: pathlib.Path, keys_file: pathlib.Path,
                extra_args: tuple[str, ...] = ()):
    """The real OpenAI shim (and chat page) in front of ``triton``, until the generator closes."""
    from backend.serving.launcher import free_port, terminate_group

    port = free_port()
    log = work / "shim.log"
    cmd = [sys.executable, "-m", "client.shim", "--triton-grpc", triton.grpc_url,
           "--host", "127.0.0.1", "--port", str(port), "--model-dir", str(model_dir),
           "--api-keys", str(keys_file), "--chat-db", str(work / "chat.sqlite3"),
           "--log-level", "warning", *extra_args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        yield Stack(f"http://127.0.0.1:{port}", model_dir, triton.metrics_url)
    finally:
        terminate_group(proc, timeout=10)


def _work_dir(prefix: str) -> tuple[pathlib.Path, pathlib.Path]:
    work = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    keys_file = work / "keys.txt"
    keys_file.write_text("".join(f"{key}:{tenant}\n" for tenant, key in KEYS.items()))
    return work, keys_file


def _need_tritonserver() -> None:
    from tests.conftest import _tritonserver_available

    if not _tritonserver_available():
        pytest.skip("tritonserver not installed (pip install nvidia-pytriton)")


@pytest.fixture(scope="session")
def chat_stack(request):
    from tests.conftest import model_dir

    tiny = model_dir("tiny")
    work, keys_file = _work_dir("chat-stack-")
    if FAKE:
        yield from _fake_stack(tiny, work, keys_file)
        return
    _need_tritonserver()
    triton = request.getfixturevalue("triton_server")   # the session's one server
    yield from _shim_stack(triton, tiny, work, keys_file)


@pytest.fixture(scope="session")
def real_chat_stack(request):
    """The same stack on the default model (SmolLM2-135M-Instruct; tests/conftest.py real_server,
    whose context window is clamped to 512 tokens by its KV pool)."""
    _need_tritonserver()
    triton = request.getfixturevalue("real_server")
    work, keys_file = _work_dir("real-chat-stack-")
    yield from _shim_stack(triton, triton.model_dir, work, keys_file)


def _fake_stack(tiny, work, keys_file):
    """Development only: the real shim app on the scripted fake client, in this process."""
    import uvicorn

    from client.fake_client import FakeLLMClient
    from client.shim.app import create_app
    from client.shim.settings import ShimSettings
    from backend.serving.launcher import free_port

    fake = FakeLLMClient(delay=0.01, piece=2, reply="lorem ipsum dolor sit amet " * 40)
    app = create_app(ShimSettings(model_dir=str(tiny), api_keys_file=str(keys_file),
                                  chat_db_path=str(work / "chat.sqlite3")), client=fake)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_http(f"http://127.0.0.1:{port}/health", None, work / "none")
    yield Stack(f"http://127.0.0.1:{port}", tiny, None, fake=fake)
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def chromium():
    """Debian's Chromium via Playwright (installed by scripts/install_browser.sh if missing).

    Module-scoped: Playwright's sync API keeps an event loop running on this thread while it is
    open, which would break the asyncio tests that run after the browser tests."""
    from playwright.sync_api import expect

    # Playwright's expect() retries for 5 s by default, apart from the page's default timeout (see
    # chat_page): a loaded 2-core CI host can take longer to fetch and render (a flake, not a bug)
    expect.set_options(timeout=30_000)
    if not os.path.exists(CHROMIUM):
        res = subprocess.run(["bash", str(ROOT / "scripts" / "install_browser.sh")],
                             capture_output=True, text=True, timeout=1200)
        if res.returncode != 0 or not os.path.exists(CHROMIUM):
            pytest.skip(f"Chromium is not installed and scripts/install_browser.sh could not install "
                        f"it (needs root and apt): {(res.stderr or res.stdout)[-500:]}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def chat_page(chromium):
    """A fresh browser context (own localStorage) whose page errors fail the test."""
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"errors in the page: {errors}"


@pytest.fixture(scope="session")
def output_dir() -> pathlib.Path:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    return OUTPUT
