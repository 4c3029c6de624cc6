"""TCP KV connector: engines on different hosts (RDMA / NIXL would replace the byte stream).

The prefill side runs a small server holding staged transfers in memory; the decode side connects,
both prove the shared secret (backend/disagg/wire.py: HMAC-SHA256 challenge-response, then a MAC
on every frame), and it pulls the block range it needs::

    request  {"op": "fetch", "id": ..., "first": k, "count": n, "owner": tag}  -> header + payload
             {"op": "release", "id": ..., "owner": tag}                        -> header
    response {"ok": true, "nbytes": N}  or  {"ok": false, "error": "..."}

Trust (docs/disaggregation.md): with a ``secret`` only a peer holding it gets past the handshake,
which reads fixed-size frames only; without one the server refuses to listen beyond loopback and
the client to connect beyond it. Transfer ids are 128 random bits; a transfer is served only to
its owner (an owner tag: a digest of the staging request's salt) and is otherwise "unknown" and
stays staged. The decode side checks a locator against its pool's geometry before connecting,
and the announced payload size against it before allocating. The server runs ``workers`` handler
threads, all started with it (the accept loop starts none, and survives any failure handing a
connection over), with ``backlog`` more connections waiting (any beyond are closed at once), each
connection under one overall deadline (``timeout``). A staged transfer is dropped once fetched or released; ``max_staged_bytes`` bounds
what an unresponsive decode side can pin on the prefill host (staging past it raises, and the
request is then recomputed on the decode side).
"""
from __future__ import annotations

import hmac
import socket
import threading
import time
import queue

import torch

from backend.disagg.connector import TRANSFER_ID, KVConnector, TransferError, check_locator, owner_tag
from backend.disagg.handover import parse_dtype
from common.net import is_loopback
from backend.disagg.wire import AuthError, client_handshake, server_handshake


class TcpConnector(KVConnector):
    """One object per engine process: ``serve()`` on the prefill side, ``fetch`` on the decode side."""
    kind = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | str | None = None,
                 timeout: float = 10.0, max_staged_bytes: int = 1 << 30, workers: int = 4, backlog: int = 16,
                 fail_after_bytes: int | None = None):
        """``fail_after_bytes``: fault injection for tests (the server drops a fetch mid-payload)."""
        super().__init__()
        self.host, self.port, self.timeout = host, port, timeout
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.max_staged_bytes = max_staged_bytes
        self.fail_after_bytes = fail_after_bytes
        self.workers, self.backlog = workers, backlog
        self._staged: dict[str, tuple[torch.Tensor, str]] = {}   # transfer id -> (blocks, owner tag)
        self._staged_at: dict[str, float] = {}     # transfer id -> time.monotonic() of staging (TTL)
        self._staged_bytes = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._conns: queue.SimpleQueue = queue.SimpleQueue()     # accepted, for the workers
        self._slots = threading.Semaphore(workers + backlog)     # connections held at once

    @property
    def _key(self) -> bytes:
        return self.secret or b""

    # -- prefill side -----------------------------------------------------------------------
    def serve(self) -> tuple[str, int]:
        """Start the server thread (idempotent); returns the bound (host, port). Refuses a
        non-loopback address without a secret."""
        if self._sock is None:
            if not self.secret and not is_loopback(self.host):
                raise ValueError(f"the TCP KV connector will not listen on {self.host!r} without a shared "
                                 "secret (engine option kv_secret_file); bind 127.0.0.1 or give one")
            sock = socket.create_server((self.host, self.port))
            self.port = sock.getsockname()[1]
            self._sock = sock
            for i in range(self.workers):           # all started here: the accept loop starts none
                threading.Thread(target=self._worker, name=f"kv-tcp-worker-{i}", daemon=True).start()
            self._thread = threading.Thread(target=self._accept_loop, args=(sock,), name="kv-tcp-server", daemon=True)
            self._thread.start()
        return self.host, self.port

    def _stage(self, transfer_id: str, blocks: torch.Tensor, owner: str) -> dict:
        self.serve()
        nbytes = blocks.numel() * blocks.element_size()
        with self._lock:
            if self._staged_bytes + nbytes > self.max_staged_bytes:
                raise TransferError(f"staging {nbytes} bytes would exceed max_staged_bytes={self.max_staged_bytes}")
            self._staged[transfer_id] = (blocks.clone(), owner)
            self._staged_at[transfer_id] = time.monotonic()
            self._staged_bytes += nbytes
        return {"host": self.host, "port": self.port, "id": transfer_id}

    def _pop(self, transfer_id: str, owner: str | None = None, reason: str | None = None) -> torch.Tensor | None:
        """The staged blocks, removed; None if unknown or (``owner`` given) another owner's.
        ``reason`` (``released``, ``expired``): the stat counted in the same step as the removal."""
        with self._lock:
            entry = self._staged.get(transfer_id)
            if entry is None or (owner is not None and not hmac.compare_digest(entry[1], owner)):
                return None
            if reason:
                self._bump(**{reason: 1})
            del self._staged[transfer_id]
            self._staged_at.pop(transfer_id, None)
            self._staged_bytes -= entry[0].numel() * entry[0].element_size()
            return entry[0]

    def _accept_loop(self, sock: socket.socket) -> None:
        # Its own reference: close() may drop self._sock before this thread first reaches accept().
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                if sock.fileno() == -1 or self._sock is not sock:
                    return                                # closed
                time.sleep(0.05)                          # EMFILE and the like: keep serving
                continue
            if not self._slots.acquire(blocking=False):  # every worker busy and the backlog full
                self._count(refused=1)
                conn.close()
                continue
            try:
                self._dispatch(conn)
            except BaseException:                         # noqa: BLE001 - whatever it was, keep accepting
                self._slots.release()
                self._count(refused=1)
                conn.close()

    def _dispatch(self, conn: socket.socket) -> None:
        self._conns.put(conn)

    def _worker(self) -> None:
        while True:
            conn = self._conns.get()
            if conn is None:
                return
            try:
                self._handle(conn)
            except BaseException:                         # noqa: BLE001 - a worker never dies of one peer
                pass

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                _no_delay(conn)
                self._serve_one(conn, time.monotonic() + self.timeout)
        except AuthError:
            self._count(auth_failures=1)
        except (OSError, TransferError, ValueError, KeyError, TypeError):
            pass                                          # the client sees a closed connection
        finally:
            self._slots.release()

    def _serve_one(self, conn: socket.socket, deadline: float) -> None:
        try:
            ch = server_handshake(conn, self._key, deadline)
        except TransferError as exc:                      # a peer that left mid-handshake proved nothing
            raise AuthError(str(exc)) from None
        req = ch.recv_header()
        tid, owner, op = req.get("id"), req.get("owner"), req.get("op")
        if not (isinstance(tid, str) and TRANSFER_ID.fullmatch(tid) and isinstance(owner, str)
                and op in ("fetch", "release")):
            self._count(refused=1)
            ch.send_header({"ok": False, "error": "malformed request"})
            return
        if op == "release":
            self._pop(tid, owner, reason="released")
            ch.send_header({"ok": True})
            return
        first, count = req.get("first"), req.get("count")
        with self._lock:
            entry = self._staged.get(tid)
        if entry is None or not hmac.compare_digest(entry[1], owner):
            self._count(refused=1)                        # another owner's: as if it did not exist
            ch.send_header({"ok": False, "error": "unknown or already fetched transfer"})
            return
        total = entry[0].shape[0]
        if not (isinstance(first, int) and isinstance(count, int) and 0 <= first and 0 <= count
                and first + count <= total):
            self._count(refused=1)
            ch.send_header({"ok": False, "error": "block range out of bounds"})
            return
        blocks = self._pop(tid, owner)
        if blocks is None:                                # fetched by a concurrent connection
            ch.send_header({"ok": False, "error": "unknown or already fetched transfer"})
            return
        data = blocks[first:first + count].contiguous().reshape(-1).view(torch.uint8).numpy()
        ch.send_header({"ok": True, "nbytes": data.nbytes})
        ch.send_payload(memoryview(data), cut_after=self.fail_after_bytes)

    # -- decode side ------------------------------------------------------------------------
    def _connect(self, locator: dict) -> tuple[socket.socket, float]:
        host, port = locator.get("host"), locator.get("port")
        if not (isinstance(host, str) and len(host) <= 255 and isinstance(port, int) and 0 < port < 65536):
            raise TransferError(f"bad TCP locator address {host!r}:{port!r}")
        if not self.secret and not is_loopback(host):
            raise TransferError(f"no kv secret: will not fetch from non-loopback {host}")
        tid = locator.get("id")
        if not (isinstance(tid, str) and TRANSFER_ID.fullmatch(tid)):
            raise TransferError("bad TCP locator transfer id")
        deadline = time.monotonic() + self.timeout
        sock = socket.create_connection((host, port), timeout=self.timeout)
        _no_delay(sock)
        return sock, deadline

    def _fetch(self, locator: dict, first_block: int, count: int, owner: str) -> torch.Tensor:
        shape, dtype_name, expect = check_locator(locator, first_block, count, self.geometry)
        dtype = parse_dtype(dtype_name)
        sock, deadline = self._connect(locator)
        with sock:
            ch = client_handshake(sock, self._key, deadline)
            ch.send_header({"op": "fetch", "id": locator["id"], "first": first_block, "count": count,
                            "owner": owner})
            resp = ch.recv_header()
            if not resp.get("ok"):
                raise TransferError(f"peer refused the fetch: {resp.get('error')}")
            if resp.get("nbytes") != expect:
                raise TransferError(f"peer offers {resp.get('nbytes')} bytes, expected {expect}")
            buf = ch.recv_payload(expect, on_alloc=lambda n: self._count(rx_alloc_bytes=n))
        if not expect:
            return torch.empty(0, *shape[1:], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).view(count, *shape[1:])

    def release(self, locator: dict, owner: str | None = None) -> None:
        """Drop a staged transfer: locally when this side staged it, else ask its server.
        ``owner`` None: this side's own transfer (it staged it); else only that owner's."""
        if not isinstance(locator, dict) or locator.get("kind") != self.kind:
            return
        tag = None if owner is None else owner_tag(owner)
        tid = locator.get("id")
        if self._sock is not None and (locator.get("host"), locator.get("port")) == (self.host, self.port):
            if isinstance(tid, str):
                self._pop(tid, tag, reason="released")
            return
        try:
            sock, deadline = self._connect(locator)
            with sock:
                ch = client_handshake(sock, self._key, deadline)
                ch.send_header({"op": "release", "id": tid, "owner": tag or owner_tag(None)})
                ch.recv_header()
        except (OSError, TransferError):
            pass                                          # the server is gone: nothing staged there either

    def expire(self, ttl: float) -> int:
        now = time.monotonic()
        with self._lock:
            old = [tid for tid, t in self._staged_at.items() if now - t >= ttl]
        return sum(self._pop(tid, reason="expired") is not None for tid in old)

    def num_staged(self) -> int:
        with self._lock:
            return len(self._staged)

    def close(self) -> None:
        self.stop_reaper()
        if self._sock is not None:
            sock, self._sock = self._sock, None
            try:
                sock.shutdown(socket.SHUT_RDWR)           # wakes the blocked accept()
            except OSError:
                pass
            sock.close()
            for _ in range(self.workers):
                self._conns.put(None)                     # the workers end once their peer is done
        with self._lock:
            self._staged.clear()
            self._staged_at.clear()
            self._staged_bytes = 0


def _no_delay(sock: socket.socket) -> None:
    """Small frames back to back (the handshake's proof, then the request header): without
    TCP_NODELAY the second waits for the peer's delayed ACK (~40 ms on Linux)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
