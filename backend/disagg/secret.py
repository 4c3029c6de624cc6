"""The KV connector's shared secret: made per pair by the launcher, read from a 0600 file by each
role (never on a command line), and the loopback rule for running without one. No torch here:
the Ray driver and replicas import it."""
from __future__ import annotations

import os
import secrets
import stat

MIN_SECRET = 16                      # bytes of the secret file (after stripping whitespace)


def new_secret() -> str:
    return secrets.token_hex(32)


def write_secret(path: str | os.PathLike, secret: str | None = None) -> str:
    """Create ``path`` (mode 0600, must not exist) holding ``secret`` (default: a fresh one);
    returns the path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((secret or new_secret()) + "\n")
    return str(path)


def load_secret(path: str | os.PathLike) -> bytes:
    """The secret in ``path``: a regular file of this user's, not readable by group or others
    (as ssh keys), of at least MIN_SECRET bytes. Any other file is a clear error."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"kv_secret_file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"kv_secret_file {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise ValueError(f"kv_secret_file {path} belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & 0o077:
            raise ValueError(f"kv_secret_file {path} has mode {st.st_mode & 0o777:o}; it must be 0600")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_SECRET:
        raise ValueError(f"kv_secret_file {path} holds {len(data)} bytes; at least {MIN_SECRET} are needed")
    return data

