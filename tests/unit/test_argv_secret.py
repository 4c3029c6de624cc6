"""backend/serving/argv_secret.py + csrc/argv_secret.c: a secret handed to a process by file reaches
its argv before main() while its visible command line (/proc/<pid>/cmdline, readable by every local
user) shows only the path of a file that is gone; a file anyone else could read or plant is refused
before main() runs (issue 30: tritonserver's admin key)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from backend.serving.argv_secret import MARK, hide, write_secret

pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="no C compiler")

# the child prints what main() got and what the kernel shows as its command line
SHOW = "import sys; print(repr(sys.argv[1:])); print(repr(open('/proc/self/cmdline').read().split('\\0')[3:-1]))"
SECRET = "k3y-" + "9f" * 16


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SHOW, *args], env=env, capture_output=True, text=True, timeout=60)


def test_the_secret_reaches_argv_but_not_the_command_line(tmp_path):
    args = ["--plain", f"--http-restricted-api=model-repository:admin={SECRET}", f"--grpc=admin={SECRET}"]
    hidden, env, path = hide(args, SECRET, tmp_path, dict(os.environ))
    assert path is not None and path.exists() and (path.stat().st_mode & 0o777) == 0o600
    assert all(SECRET not in a for a in hidden) and hidden[0] == "--plain"
    out = _run(hidden, env)
    assert out.returncode == 0, out.stderr
    seen_by_main, cmdline = (eval(line) for line in out.stdout.splitlines())
    assert seen_by_main == args                                   # both arguments, the rest untouched
    assert cmdline == hidden and SECRET not in out.stdout.splitlines()[1]
    assert not path.exists()                                      # the key now lives only in memory


@pytest.mark.parametrize("spoil", ["group-readable", "missing", "symlink", "empty"])
def test_a_bad_secret_file_stops_the_process_before_main(tmp_path, spoil):
    hidden, env, path = hide([f"--key={SECRET}"], SECRET, tmp_path, dict(os.environ))
    assert path is not None
    if spoil == "group-readable":
        os.chmod(path, 0o640)
    elif spoil == "missing":
        path.unlink()
    elif spoil == "symlink":
        real = write_secret(tmp_path, SECRET)
        path.unlink()
        path.symlink_to(real)
    else:
        path.write_text("")
    out = _run(hidden, env)
    assert out.returncode == 78 and out.stdout == "", (out.returncode, out.stdout)
    assert out.stderr.startswith("argv_secret: ") and str(path) in out.stderr


def test_processes_without_the_marker_are_untouched(tmp_path):
    _, env, path = hide([f"--key={SECRET}"], SECRET, tmp_path, dict(os.environ, LD_PRELOAD=""))
    out = _run(["--a", MARK.rstrip(":")], env)                  # e.g. the server's Python stubs
    assert out.returncode == 0 and eval(out.stdout.splitlines()[0]) == ["--a", MARK.rstrip(":")]
    assert path is not None and path.exists()                     # only a process given it reads it


def test_a_loader_path_ld_preload_would_split_leaves_the_arguments_as_they_are(tmp_path, monkeypatch):
    from backend.serving import argv_secret

    monkeypatch.setattr(argv_secret, "preload_library", lambda: tmp_path / "with space" / "argv_secret.so")
    args = [f"--key={SECRET}"]
    assert hide(args, SECRET, tmp_path, {}) == (args, {}, None)      # never a reference the server would keep
