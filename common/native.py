"""Native code built on the spot: C sources compiled once with the system compiler into a private
cache and loaded only after an owner check (kernels/cpu.py, backend/quant/cpu.py, the launcher's
backend/serving/argv_secret.py). Torch-free, so the launcher can use it.

Cache: ``build/kernels/<source>-<hash>.so`` where the hash covers the sources, the compiler flags
and this CPU's flags (``-march=native`` code must not run on another CPU), or
``$TRITON_LLM_KERNEL_CACHE``; where the repository is not writable, ``~/.cache/triton_llm/kernels``.
Why the checks: ``ctypes.CDLL`` (or ``LD_PRELOAD``) runs a library's constructors in the loading
process, so a library another user could plant or change is code execution as us. The folder must
be owned by this user and is made (or tightened to) mode 0700; a folder owned by someone else is
refused, and a cached library is used only if it is ours and not group/other-writable (else
rebuilt). No predictable shared ``/tmp`` path: with no usable folder nothing is built.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import stat
import subprocess

from common import env

log = logging.getLogger("triton_llm.native")


def cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def private_dir(d: pathlib.Path, uid: int | None = None) -> bool:
    """Make ``d`` (if missing) and check it is a real folder owned by ``uid`` (this user); tighten
    it to 0700. False (and a warning) when it cannot be made or belongs to someone else."""
    uid = os.geteuid() if uid is None else uid
    try:
        d.mkdir(parents=True, mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            log.warning("native-code cache %s is not a folder owned by uid %d: not used", d, uid)
            return False
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(d, 0o700)
        return True
    except OSError as exc:
        log.warning("native-code cache %s unusable: %s", d, exc)
        return False


def cache_dir(uid: int | None = None) -> pathlib.Path | None:
    """The compiled-library folder (module docstring), or None: no private folder to be had."""
    chosen = env.raw("TRITON_LLM_KERNEL_CACHE")
    if chosen:                  # the user's explicit choice: that folder or none
        return pathlib.Path(chosen) if private_dir(pathlib.Path(chosen), uid) else None
    for d in (pathlib.Path(__file__).resolve().parents[1] / "build" / "kernels",
              pathlib.Path.home() / ".cache" / "triton_llm" / "kernels"):
        if private_dir(d, uid):
            return d
    return None


def trusted(lib: pathlib.Path, uid: int | None = None) -> bool:
    """A library we may load: a regular file owned by ``uid`` and writable by no one else, in a
    folder owned by ``uid`` with mode 0700."""
    uid = os.geteuid() if uid is None else uid
    try:
        d, f = os.lstat(lib.parent), os.lstat(lib)
    except OSError:
        return False
    return (stat.S_ISDIR(d.st_mode) and d.st_uid == uid and stat.S_IMODE(d.st_mode) == 0o700
            and stat.S_ISREG(f.st_mode) and f.st_uid == uid and not f.st_mode & 0o022)


def load_library(path: pathlib.Path) -> ctypes.CDLL:
    """``ctypes.CDLL`` of a library in the native-code cache, after :func:`_trusted`; OSError if not."""
    if not trusted(path):
        raise OSError(f"refusing to load {path}: not owned by this user in a private (0700) folder")
    return ctypes.CDLL(str(path))


def build(source: pathlib.Path, flags: list[str], extra: tuple[pathlib.Path, ...] = (),
          what: str = "CPU kernel") -> pathlib.Path | None:
    """Build ``source`` (+ ``extra`` sources into the same library) once into the cache; None when
    there is no compiler, no private cache folder, or the build fails (logged)."""
    cc = shutil.which(env.raw("CC") or "cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    headers = sorted(source.parent.glob("*.h"))          # included by the sources (simd_exp.h)
    key = hashlib.sha256(source.read_bytes() + b"".join(p.read_bytes() for p in (*extra, *headers))
                         + " ".join(flags).encode() + cpu_flags().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    cache = cache_dir()
    if cache is None:
        return None
    out = cache / f"{source.stem}-{key}.so"
    if out.exists() and trusted(out):
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}")       # a stale or foreign file is replaced
    proc = subprocess.run([cc, *flags, "-o", str(tmp), str(source), *map(str, extra), "-lm"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        log.warning("%s %s did not build: %s", what, source.name, proc.stderr[-500:])
        return None
    os.chmod(tmp, 0o700)            # whatever the umask: writable by no one else (trusted)
    os.replace(tmp, out)            # atomic: processes building at once each publish a whole file
    return out
