"""Secrets kept off tritonserver's command line, where every local user could read them
(``/proc/<pid>/cmdline``): tritonserver 2.51 takes its repository admin key from argv only.

:func:`hide` writes the secret to a fresh 0600 file in the server's private workdir and puts in
its place, in each argument, a reference to that file; ``csrc/argv_secret.c``, preloaded into
tritonserver, swaps the secret back into its argv before ``main()`` and deletes the file. The
command line the kernel shows keeps the (deleted) file's path. Where the library cannot be built
(no C compiler, no private cache folder), the secret stays on the command line, with a warning.
"""
from __future__ import annotations

import functools
import logging
import os
import pathlib
import secrets

from common.native import build

log = logging.getLogger("triton_llm.serving")
SOURCE = pathlib.Path(__file__).with_name("csrc") / "argv_secret.c"
MARK = "@triton-llm-secret-file:"                      # csrc/argv_secret.c's MARK


@functools.lru_cache(maxsize=1)
def preload_library() -> pathlib.Path | None:
    return build(SOURCE, ["-O2", "-shared", "-fPIC"], what="argv secret loader")


def write_secret(folder: pathlib.Path, secret: str) -> pathlib.Path:
    """``secret`` in a new file of ``folder`` that only this user can read."""
    path = folder / f".secret-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return path


def hide(args: list[str], secret: str, folder: pathlib.Path,
         env: dict[str, str]) -> tuple[list[str], dict[str, str], pathlib.Path | None]:
    """``args`` and ``env`` for a process that must see ``secret`` where ``args`` hold it, with the
    secret off the command line; and the secret's file (None: the library is missing, nothing
    changed). The file is gone once the process has started; remove it if the start failed."""
    lib = preload_library()
    if lib is None or any(c.isspace() or c == ":" for c in str(lib)):
        # LD_PRELOAD splits at spaces and colons: such a path would not load, and the server would
        # take the file reference itself for the secret
        log.warning("the argv secret loader is unavailable (%s): tritonserver's admin key is on its command line",
                    "no build" if lib is None else f"unusable path {lib}")
        return args, env, None
    path = write_secret(folder, secret)
    hidden = [a.replace(secret, MARK + str(path)) for a in args]
    preload = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    return hidden, {**env, "LD_PRELOAD": preload}, path
