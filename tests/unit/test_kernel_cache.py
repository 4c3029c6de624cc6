"""The compiled-library cache (common/native.py, used by kernels/cpu.py): ctypes.CDLL runs a
library's code in this process, so only a library this user owns, writable by no one else, in a
folder this user owns with mode 0700 is loaded; a folder of someone else's is refused; no predictable /tmp fallback (issue 30)."""
from __future__ import annotations

import os
import pathlib
import shutil
import stat

import pytest

from common import native
from kernels import cpu

OTHER_UID = 65534 if os.geteuid() != 65534 else 65533     # someone else (nobody)


def mode(p: pathlib.Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_cache_folder_is_made_private_and_tightened(tmp_path, monkeypatch):
    new = tmp_path / "a" / "cache"
    monkeypatch.setenv("TRITON_LLM_KERNEL_CACHE", str(new))
    assert native.cache_dir() == new and mode(new) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    monkeypatch.setenv("TRITON_LLM_KERNEL_CACHE", str(loose))
    assert native.cache_dir() == loose and mode(loose) == 0o700       # ours: tightened


def test_someone_elses_folder_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("TRITON_LLM_KERNEL_CACHE", str(d))
    assert native.cache_dir(uid=OTHER_UID) is None                   # as seen by another user
    if os.geteuid() == 0:                                            # really someone else's
        os.chown(d, OTHER_UID, OTHER_UID)
        assert native.cache_dir() is None
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "a-folder", target_is_directory=True)
    (tmp_path / "a-folder").mkdir(mode=0o700)
    monkeypatch.setenv("TRITON_LLM_KERNEL_CACHE", str(link))
    assert native.cache_dir() is None                                  # a symlink is not our folder


def test_no_tmp_fallback(tmp_path, monkeypatch):
    """Repository folder unusable (a file where it should be): the per-user cache under $HOME;
    that unusable too: no cache at all (the torch path), never a shared /tmp path."""
    monkeypatch.delenv("TRITON_LLM_KERNEL_CACHE", raising=False)
    fake_repo = tmp_path / "repo"
    (fake_repo / "common").mkdir(parents=True)
    (fake_repo / "build").write_text("not a folder")
    monkeypatch.setattr(native, "__file__", str(fake_repo / "common" / "native.py"))
    monkeypatch.setattr(pathlib.Path, "home", classmethod(lambda cls: tmp_path / "home"))
    got = native.cache_dir()
    assert got == tmp_path / "home" / ".cache" / "triton_llm" / "kernels" and mode(got) == 0o700
    (tmp_path / "home").rename(tmp_path / "home-gone")
    (tmp_path / "home").write_text("not a folder")
    assert native.cache_dir() is None
    monkeypatch.setenv("TRITON_LLM_KERNEL_CACHE", str(tmp_path / "home" / "x"))    # under a file
    assert native.cache_dir() is None and cpu._build() is None


def test_only_trusted_libraries_are_loaded_and_bad_ones_rebuilt(tmp_path, monkeypatch):
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler")
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_LLM_KERNEL_CACHE", str(cache))
    path = cpu._build()
    assert path is not None and path.parent == cache and mode(cache) == 0o700
    assert not os.lstat(path).st_mode & 0o022
    assert cpu.load_library(path).store_kv                           # trusted: loads

    os.chmod(path, 0o777)                                            # writable by others: refused ...
    with pytest.raises(OSError, match="refusing to load"):
        cpu.load_library(path)
    assert native.trusted(path, uid=OTHER_UID) is False
    rebuilt = cpu._build()                                            # ... and replaced by a fresh build
    assert rebuilt == path and not os.lstat(path).st_mode & 0o022
    cpu.load_library(path)

    os.chmod(cache, 0o755)                                           # folder loosened after the build
    with pytest.raises(OSError, match="refusing to load"):
        cpu.load_library(path)
    os.chmod(cache, 0o700)
    planted = cache / "planted.so"
    planted.symlink_to(path)                                         # not a regular file of ours
    with pytest.raises(OSError, match="refusing to load"):
        cpu.load_library(planted)
