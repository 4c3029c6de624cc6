"""The TCP KV connector's authenticated byte stream: a shared-secret handshake, then MAC'd frames.

Handshake (fixed sizes: nothing is allocated from what an unauthenticated peer says)::

    client -> server   MAGIC | nonce_c                               (8 + 32 bytes)
    server -> client   MAGIC | nonce_s | HMAC(K, "kv-server" nonce_c nonce_s)
    client -> server   HMAC(K, "kv-client" nonce_c nonce_s)          (only once the server proved K)
    session key        S = HMAC(K, "kv-session" nonce_c nonce_s)

Both sides prove the key over fresh nonces of both, under different labels, so no proof can be
replayed or reflected. Every frame after it carries HMAC(S, direction | sequence number | kind |
length | body): a frame cannot be altered, replayed, reordered or moved to the other direction::

    header  = u32 length + UTF-8 JSON (at most MAX_HEADER) + 32-byte MAC
    payload = u64 length + raw bytes                          + 32-byte MAC

The receiver checks a header's MAC before parsing it, and a payload's length against what it
expects before allocating it (its MAC before returning it). Frames are not encrypted: the KV is
readable on the path; keep the port on loopback or a private network (docs/disaggregation.md).

Without a secret the key is empty: the same protocol, no authentication (loopback only, enforced
by the connector); the MACs then only catch corruption.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import time

from backend.disagg.connector import TransferError

MAGIC = b"LLMKV/2\n"
NONCE = 32
TAG = 32
MAX_HEADER = 64 * 1024
CHUNK = 256 * 1024                   # payloads are hashed in chunks as they cross (overlaps both sides)


class AuthError(TransferError):
    """The peer did not prove the shared secret (or spoke another protocol)."""


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError("the transfer's deadline passed")
    return left


def recv_exact(sock: socket.socket, n: int, deadline: float, into: bytearray | None = None) -> bytearray:
    buf = into if into is not None else bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        sock.settimeout(_remaining(deadline))
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def _send(sock: socket.socket, data, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    sock.sendall(data)


def _tag(key: bytes, label: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(key, label + nonce_c + nonce_s, hashlib.sha256).digest()


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> "Channel":
    nonce_c = secrets.token_bytes(NONCE)
    _send(sock, MAGIC + nonce_c, deadline)
    hello = recv_exact(sock, len(MAGIC) + NONCE + TAG, deadline)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthError("the KV peer speaks another protocol")
    nonce_s, proof = bytes(hello[len(MAGIC):-TAG]), bytes(hello[-TAG:])
    if not hmac.compare_digest(proof, _tag(secret, b"kv-server", nonce_c, nonce_s)):
        raise AuthError("the KV peer failed authentication (wrong or missing kv secret)")
    _send(sock, _tag(secret, b"kv-client", nonce_c, nonce_s), deadline)
    return Channel(sock, _tag(secret, b"kv-session", nonce_c, nonce_s), client=True, deadline=deadline)


def server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> "Channel":
    hello = recv_exact(sock, len(MAGIC) + NONCE, deadline)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthError("not a KV client (protocol magic)")
    nonce_c, nonce_s = bytes(hello[len(MAGIC):]), secrets.token_bytes(NONCE)
    _send(sock, MAGIC + nonce_s + _tag(secret, b"kv-server", nonce_c, nonce_s), deadline)
    proof = bytes(recv_exact(sock, TAG, deadline))
    if not hmac.compare_digest(proof, _tag(secret, b"kv-client", nonce_c, nonce_s)):
        raise AuthError("the KV client failed authentication")
    return Channel(sock, _tag(secret, b"kv-session", nonce_c, nonce_s), client=False, deadline=deadline)


class Channel:
    """MAC'd frames over an authenticated connection, under one overall deadline."""

    def __init__(self, sock: socket.socket, key: bytes, *, client: bool, deadline: float) -> None:
        self.sock, self.key, self.deadline = sock, key, deadline
        self.tx_dir, self.rx_dir = (b"c2s", b"s2c") if client else (b"s2c", b"c2s")
        self.tx_seq = self.rx_seq = 0

    def _mac(self, direction: bytes, seq: int, kind: bytes, length: int, body) -> hmac.HMAC:
        m = hmac.new(self.key, direction + struct.pack(">Q", seq) + kind + struct.pack(">Q", length),
                     hashlib.sha256)
        m.update(body)                   # hashlib releases the GIL for large buffers
        return m

    def send_header(self, header: dict) -> None:
        h = json.dumps(header).encode()
        mac = self._mac(self.tx_dir, self.tx_seq, b"H", len(h), h).digest()
        self.tx_seq += 1
        _send(self.sock, struct.pack(">I", len(h)) + h + mac, self.deadline)

    def recv_header(self) -> dict:
        (n,) = struct.unpack(">I", recv_exact(self.sock, 4, self.deadline))
        if n > MAX_HEADER:
            raise TransferError(f"header of {n} bytes exceeds {MAX_HEADER}")
        body = recv_exact(self.sock, n + TAG, self.deadline)
        h, mac = body[:n], bytes(body[n:])
        if not hmac.compare_digest(mac, self._mac(self.rx_dir, self.rx_seq, b"H", n, h).digest()):
            raise AuthError("a KV header failed its MAC")
        self.rx_seq += 1
        out = json.loads(h)
        if not isinstance(out, dict):
            raise TransferError("a KV header is not a JSON object")
        return out

    def send_payload(self, data: memoryview, *, cut_after: int | None = None) -> None:
        """``cut_after``: fault injection for tests (send that many bytes, then stop). The MAC is
        computed chunk by chunk as the data goes out, so the peer hashes while this side sends."""
        data = memoryview(data).cast("B")
        mac = self._mac(self.tx_dir, self.tx_seq, b"P", len(data), b"")
        self.tx_seq += 1
        _send(self.sock, struct.pack(">Q", len(data)), self.deadline)
        end = len(data) if cut_after is None else min(cut_after, len(data))
        for i in range(0, end, CHUNK):
            part = data[i:min(i + CHUNK, end)]
            mac.update(part)
            _send(self.sock, part, self.deadline)
        if cut_after is None:
            _send(self.sock, mac.digest(), self.deadline)

    def recv_payload(self, expect: int, on_alloc=None) -> bytearray:
        """The next payload, which must be exactly ``expect`` bytes: its announced length is
        checked before anything is allocated (``on_alloc(n)`` is told then), its MAC after
        (hashed chunk by chunk as it arrives)."""
        (n,) = struct.unpack(">Q", recv_exact(self.sock, 8, self.deadline))
        if n != expect:
            raise TransferError(f"payload of {n} bytes, expected {expect}")
        if on_alloc is not None:
            on_alloc(n)
        buf = bytearray(n)
        view = memoryview(buf)
        mac = self._mac(self.rx_dir, self.rx_seq, b"P", n, b"")
        for i in range(0, n, CHUNK):
            part = view[i:min(i + CHUNK, n)]
            recv_exact(self.sock, len(part), self.deadline, into=part)
            mac.update(part)
        tag = bytes(recv_exact(self.sock, TAG, self.deadline))
        if not hmac.compare_digest(tag, mac.digest()):
            raise AuthError("a KV payload failed its MAC (altered on the way)")
        self.rx_seq += 1
        return buf
