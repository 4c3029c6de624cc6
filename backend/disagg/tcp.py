"""TCP KV connector: engines on different hosts (RDMA / NIXL would replace the byte stream).

The prefill side runs a small server holding staged transfers in memory; the decode side connects
and pulls the block range it needs. Frames are length-prefixed::

    header  = u32 big-endian length + UTF-8 JSON      (at most MAX_HEADER bytes)
    payload = u64 big-endian length + raw tensor bytes

    request  {"op": "fetch", "id": ..., "first": k, "count": n, "token": ...}   -> header + payload
             {"op": "release", "id": ..., "token": ...}                          -> header
    response {"ok": true, "nbytes": N}  or  {"ok": false, "error": "..."}

Trust: the server binds loopback unless told otherwise and, given a ``token``, answers only
requests carrying it (compared in constant time). Sizes are checked against the locator before a
byte is read, so a confused peer cannot make the receiver allocate unbounded memory. A staged
transfer is dropped once fetched or released; ``max_staged_bytes`` bounds what an unresponsive
decode side can pin on the prefill host (staging past it raises, and the request is then
recomputed on the decode side).
"""
from __future__ import annotations

import hmac
import json
import socket
import struct
import threading
import time

import torch

from backend.disagg.connector import KVConnector, TransferError
from backend.disagg.handover import parse_dtype

MAX_HEADER = 64 * 1024


def send_frame(sock: socket.socket, header: dict, payload: bytes | memoryview | None = None) -> None:
    h = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(h)) + h)
    if payload is not None:
        sock.sendall(struct.pack(">Q", len(payload)))
        sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def recv_header(sock: socket.socket) -> dict:
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise TransferError(f"header of {n} bytes exceeds {MAX_HEADER}")
    return json.loads(recv_exact(sock, n))


class TcpConnector(KVConnector):
    """One object per engine process: ``serve()`` on the prefill side, ``fetch`` on the decode side."""
    kind = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 timeout: float = 10.0, max_staged_bytes: int = 1 << 30, fail_after_bytes: int | None = None):
        """``fail_after_bytes``: fault injection for tests (the server drops a fetch mid-payload)."""
        super().__init__()
        self.host, self.port, self.token, self.timeout = host, port, token, timeout
        self.max_staged_bytes = max_staged_bytes
        self.fail_after_bytes = fail_after_bytes
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_at: dict[str, float] = {}     # transfer id -> time.monotonic() of staging (TTL)
        self._staged_bytes = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    # -- prefill side -----------------------------------------------------------------------
    def serve(self) -> tuple[str, int]:
        """Start the server thread (idempotent); returns the bound (host, port)."""
        if self._sock is None:
            sock = socket.create_server((self.host, self.port))
            self.port = sock.getsockname()[1]
            self._sock = sock
            self._thread = threading.Thread(target=self._accept_loop, args=(sock,), name="kv-tcp-server", daemon=True)
            self._thread.start()
        return self.host, self.port

    def _stage(self, transfer_id: str, blocks: torch.Tensor) -> dict:
        self.serve()
        nbytes = blocks.numel() * blocks.element_size()
        with self._lock:
            if self._staged_bytes + nbytes > self.max_staged_bytes:
                raise TransferError(f"staging {nbytes} bytes would exceed max_staged_bytes={self.max_staged_bytes}")
            old = self._staged.pop(transfer_id, None)
            if old is not None:                       # the same id staged again: replace it
                self._staged_bytes -= old.numel() * old.element_size()
            self._staged[transfer_id] = blocks.clone()
            self._staged_at[transfer_id] = time.monotonic()
            self._staged_bytes += nbytes
        return {"host": self.host, "port": self.port, "id": transfer_id}

    def _pop(self, transfer_id: str) -> torch.Tensor | None:
        with self._lock:
            t = self._staged.pop(transfer_id, None)
            self._staged_at.pop(transfer_id, None)
            if t is not None:
                self._staged_bytes -= t.numel() * t.element_size()
            return t

    def _accept_loop(self, sock: socket.socket) -> None:
        # Its own reference: close() may drop self._sock before this thread first reaches accept()
        # (a connector closed right after serving: an AttributeError in this thread, CI at 606081b).
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return                                    # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self.timeout)
                req = recv_header(conn)
                if self.token is not None and not hmac.compare_digest(str(req.get("token", "")), self.token):
                    send_frame(conn, {"ok": False, "error": "bad token"})
                    return
                blocks = self._pop(str(req.get("id")))
                if req.get("op") == "release":
                    if blocks is not None:
                        self._count(released=1)
                    send_frame(conn, {"ok": True})
                    return
                if blocks is None:
                    send_frame(conn, {"ok": False, "error": "unknown or already fetched transfer"})
                    return
                first, count = int(req["first"]), int(req["count"])
                if not (0 <= first and 0 <= count and first + count <= blocks.shape[0]):
                    send_frame(conn, {"ok": False, "error": "block range out of bounds"})
                    return
                data = blocks[first:first + count].contiguous().reshape(-1).view(torch.uint8).numpy()
                if self.fail_after_bytes is not None:
                    send_frame(conn, {"ok": True, "nbytes": data.nbytes})
                    conn.sendall(struct.pack(">Q", data.nbytes) + data.tobytes()[:self.fail_after_bytes])
                    return                                # drop mid-way
                send_frame(conn, {"ok": True, "nbytes": data.nbytes}, memoryview(data))
            except (OSError, TransferError, ValueError, KeyError):
                return                                    # the client sees a closed connection

    # -- decode side ------------------------------------------------------------------------
    def _fetch(self, locator: dict, first_block: int, count: int) -> torch.Tensor:
        shape = locator["shape"]
        dtype = parse_dtype(locator["dtype"])
        per_block = 1
        for d in shape[1:]:
            per_block *= d
        expect = count * per_block * torch.empty((), dtype=dtype).element_size()
        with socket.create_connection((locator["host"], locator["port"]), timeout=self.timeout) as sock:
            send_frame(sock, {"op": "fetch", "id": locator["id"], "first": first_block, "count": count,
                              "token": self.token})
            resp = recv_header(sock)
            if not resp.get("ok"):
                raise TransferError(f"peer refused the fetch: {resp.get('error')}")
            if resp.get("nbytes") != expect:
                raise TransferError(f"peer offers {resp.get('nbytes')} bytes, expected {expect}")
            (n,) = struct.unpack(">Q", recv_exact(sock, 8))
            if n != expect:
                raise TransferError(f"payload of {n} bytes, expected {expect}")
            buf = recv_exact(sock, n)
        return torch.frombuffer(buf, dtype=dtype).view(count, *shape[1:]) if n else torch.empty(0, *shape[1:], dtype=dtype)

    def release(self, locator: dict) -> None:
        """Drop a staged transfer: locally when this side staged it, else ask its server."""
        if locator.get("kind") != self.kind:
            return
        if self._sock is not None and (locator.get("host"), locator.get("port")) == (self.host, self.port):
            if self._pop(locator["id"]) is not None:
                self._count(released=1)
            return
        try:
            with socket.create_connection((locator["host"], locator["port"]), timeout=self.timeout) as sock:
                send_frame(sock, {"op": "release", "id": locator["id"], "token": self.token})
                recv_header(sock)
        except (OSError, TransferError):
            pass                                          # the server is gone: nothing staged there either

    def expire(self, ttl: float) -> int:
        now = time.monotonic()
        with self._lock:
            old = [tid for tid, t in self._staged_at.items() if now - t >= ttl]
        n = sum(self._pop(tid) is not None for tid in old)
        if n:
            self._count(expired=n)
        return n

    def num_staged(self) -> int:
        with self._lock:
            return len(self._staged)

    def close(self) -> None:
        self.stop_reaper()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)     # wakes the blocked accept()
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        with self._lock:
            self._staged.clear()
            self._staged_at.clear()
            self._staged_bytes = 0
