"""Where ``import-gguf --out DIR`` writes: never over anything the importer did not write.

An import is built in a fresh temporary directory beside ``DIR`` and then put in place:

- ``DIR`` absent: the temporary directory is renamed to ``DIR`` (atomic).
- ``DIR`` empty, or a previous import (it holds :data:`MANIFEST`, listing the files that import
  wrote): the new files are moved in one by one, the old import's files the new one does not
  write are removed, and any other file (one the user added) stays. ``config.json`` is removed
  first and moved in last, so an interrupted replacement never looks like a loadable checkpoint;
  the manifest is rewritten first with old and new files, so a rerun may replace all of them.
- anything else (a non-empty directory without the manifest, a file): refused before any work.

Moving files in, rather than renaming over ``DIR``, also keeps ``--out .`` from pulling the current
directory out from under the shell.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

from backend.model.gguf_header import GGUFError

MANIFEST = "import-gguf-manifest.json"
WRITTEN_BY = "triton-llm import-gguf"
_MAX_MANIFEST_BYTES = 1 << 20
_LAST = "config.json"        # what makes a directory a checkpoint: written last, removed first


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name and "\0" not in name


def previous_files(out: pathlib.Path) -> list[str] | None:
    """The files a previous import wrote into ``out`` (from its manifest), or None if ``out`` has
    no readable manifest of ours."""
    path = out / MANIFEST
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > _MAX_MANIFEST_BYTES:
            return None
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("written_by") != WRITTEN_BY:
        return None
    files = manifest.get("files")
    return files if isinstance(files, list) and all(_plain_name(f) for f in files) else None


def check_target(out: pathlib.Path) -> list[str]:
    """GGUFError unless ``out`` may receive an import; the previous import's files ([] if none)."""
    if not os.path.lexists(out):
        return []
    if not out.is_dir():
        raise GGUFError(f"--out {out}: exists and is not a directory")
    old = previous_files(out)
    if old is not None:
        return old
    if any(out.iterdir()):
        raise GGUFError(f"--out {out}: the directory is not empty and is not a previous import (no "
                        f"{MANIFEST}); nothing was written. Choose a new or empty directory")
    return []


def staging_dir(out: pathlib.Path) -> pathlib.Path:
    """A fresh directory beside ``out`` (same filesystem, so renames are moves, not copies)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staged.chmod(0o777 & ~umask)          # mkdtemp's 0700 would make the renamed checkpoint private
    return staged


def _write_manifest(directory: pathlib.Path, files: list[str], source: str) -> None:
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"written_by": WRITTEN_BY, "source": source, "files": sorted(files)},
                              indent=2) + "\n")
    os.replace(tmp, directory / MANIFEST)


def _unlink_own(out: pathlib.Path, name: str) -> None:
    """Remove a file an import wrote; a directory or link found under that name is not ours."""
    path = out / name
    if path.is_file() and not path.is_symlink():
        path.unlink()


def put_in_place(staged: pathlib.Path, out: pathlib.Path, source: str) -> None:
    """Move the finished import in ``staged`` to ``out`` (see the module docstring); ``staged`` is
    gone afterwards. GGUFError if ``out`` changed into something that may not be replaced."""
    new = sorted(p.name for p in staged.iterdir())
    old = check_target(out)
    if not os.path.lexists(out):
        _write_manifest(staged, new, source)
        staged.rename(out)
        return
    clash = [n for n in new if n not in old and os.path.lexists(out / n)]
    if clash:
        raise GGUFError(f"--out {out}: {clash[0]} is there and was not written by an import; "
                        "nothing was replaced")
    _write_manifest(out, sorted(set(old) | set(new)), source)
    _unlink_own(out, _LAST)
    for name in sorted(new, key=lambda n: n == _LAST):
        os.replace(staged / name, out / name)
    for name in set(old) - set(new):
        _unlink_own(out, name)
    _write_manifest(out, new, source)
    staged.rmdir()


def discard(staged: pathlib.Path) -> None:
    """Remove a staging directory (ours: made by :func:`staging_dir`) after a failed import."""
    shutil.rmtree(staged, ignore_errors=True)
