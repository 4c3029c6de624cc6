"""Attacks on the TCP KV connector, over real loopback sockets, that must fail: a wrong or missing
secret, a raw client that never proves it, oversized or altered frames, another tenant's fetch,
a flood of idle connections, a failed thread start; and the refusal to listen beyond loopback
without a secret."""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch

from backend.config import EngineArgs
from backend.disagg.connector import KVGeometry, TransferError
from backend.disagg.secret import load_secret, write_secret
from backend.disagg.tcp import TcpConnector
from backend.disagg.wire import MAGIC, NONCE, TAG, AuthError, server_handshake

SHAPE = (5, 2, 2, 4, 2, 3)          # [blocks, layers, k/v, block_size, heads, dim]
KEY = "a-secret-of-the-pair-0123456789"
BLOCKS = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)


@pytest.fixture
def server():
    srv = TcpConnector(secret=KEY, timeout=5.0)
    yield srv
    srv.close()


def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("client_secret", ["another-secret-of-32-characters", None])
def test_a_wrong_or_missing_secret_is_refused_before_any_allocation(server, client_secret):
    loc = server.stage(BLOCKS, owner="tenant:a")
    client = TcpConnector(secret=client_secret, timeout=5.0)
    with pytest.raises(AuthError, match="failed authentication"):
        client.fetch(loc, 0, 5, owner="tenant:a")
    assert client.stats().rx_alloc_bytes == 0 and client.stats().fetched_bytes == 0
    _until(lambda: server.stats().auth_failures == 1)        # the server read no request from it
    assert server.num_staged() == 1                          # untouched
    good = TcpConnector(secret=KEY, timeout=5.0)
    assert torch.equal(good.fetch(loc, 0, 5, owner="tenant:a"), BLOCKS)
    assert good.stats().rx_alloc_bytes == BLOCKS.numel() * 4


def test_a_client_with_the_secret_refuses_a_server_without_it():
    srv = TcpConnector(timeout=5.0)                          # no secret (loopback)
    try:
        loc = srv.stage(BLOCKS)
        client = TcpConnector(secret=KEY, timeout=5.0)
        with pytest.raises(AuthError):
            client.fetch(loc, 0, 5)
        assert client.stats().rx_alloc_bytes == 0 and srv.num_staged() == 1
    finally:
        srv.close()


def test_a_raw_client_gets_nothing_before_proving_the_key(server):
    server.stage(BLOCKS)
    host, port = server.serve()
    # the old unauthenticated protocol (a JSON header with a token): no magic, closed at once
    with socket.create_connection((host, port)) as s:
        h = b'{"op": "fetch", "id": "x", "first": 0, "count": 5, "token": ""}'
        s.sendall(struct.pack(">I", len(h)) + h)
        assert _closed_by_peer(s)
    # speaks the handshake, forges the proof, then claims a 4 GiB header
    with socket.create_connection((host, port)) as s:
        s.sendall(MAGIC + b"\0" * NONCE)
        s.settimeout(10)
        hello = b""
        while len(hello) < len(MAGIC) + NONCE + TAG:
            hello += s.recv(256)
        try:
            s.sendall(b"\1" * TAG + struct.pack(">I", 0xFFFFFFFF))
        except OSError:
            pass
        assert _closed_by_peer(s)
    _until(lambda: server.stats().auth_failures == 2)
    assert server.num_staged() == 1


def _fake_server(respond) -> tuple[socket.socket, threading.Thread]:
    """A peer that holds the key but answers a fetch with ``respond(channel, conn)``."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lsock.accept()
        with conn:
            ch = server_handshake(conn, KEY.encode(), time.monotonic() + 10)
            ch.recv_header()
            respond(ch, conn)
            time.sleep(0.2)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lsock, t


def _loc(lsock: socket.socket, blocks: int = 5) -> dict:
    return {"kind": "tcp", "host": "127.0.0.1", "port": lsock.getsockname()[1], "id": "ab" * 16,
            "shape": [blocks, *SHAPE[1:]], "dtype": "float32"}


@pytest.mark.parametrize("attack", ["payload_length", "header_length", "nbytes"])
def test_an_oversized_frame_is_refused_without_allocating(attack):
    expect = BLOCKS.numel() * 4

    def respond(ch, conn):
        if attack == "header_length":                       # a 2 GiB header after the handshake
            conn.sendall(struct.pack(">I", 1 << 31))
            return
        ch.send_header({"ok": True, "nbytes": 1 << 40 if attack == "nbytes" else expect})
        conn.sendall(struct.pack(">Q", 1 << 40))            # announces a 1 TiB payload

    lsock, t = _fake_server(respond)
    client = TcpConnector(secret=KEY, timeout=5.0)
    try:
        with pytest.raises(TransferError, match="exceeds|expected"):
            client.fetch(_loc(lsock), 0, 5)
    finally:
        t.join(10)
        lsock.close()
    assert client.stats().rx_alloc_bytes == 0


def test_a_payload_altered_on_the_way_is_refused():
    def respond(ch, conn):
        ch.send_header({"ok": True, "nbytes": BLOCKS.numel() * 4})
        data = bytearray(BLOCKS.numpy().tobytes())
        mac = ch._mac(ch.tx_dir, ch.tx_seq, b"P", len(data), data).digest()
        data[100] ^= 1                                     # one bit flipped after the MAC
        conn.sendall(struct.pack(">Q", len(data)) + data + mac)

    lsock, t = _fake_server(respond)
    try:
        with pytest.raises(AuthError, match="MAC"):
            TcpConnector(secret=KEY, timeout=5.0).fetch(_loc(lsock), 0, 5)
    finally:
        t.join(10)
        lsock.close()


def test_a_locator_outside_the_pool_geometry_is_refused_before_connecting():
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(0.5)
    client = TcpConnector(secret=KEY, timeout=5.0)
    client.set_geometry(KVGeometry(tuple(SHAPE[1:]), "float32", max_blocks=8))
    try:
        bad = [{**_loc(lsock), "shape": [9, *SHAPE[1:]]},             # more blocks than a request has
               {**_loc(lsock), "shape": [5, 2, 2, 4, 2, 3000]},       # another head dim
               {**_loc(lsock), "dtype": "float64"},
               {**_loc(lsock), "shape": [5, 2, 2, 4, 2]}]
        for loc in bad:
            with pytest.raises(TransferError):
                client.fetch(loc, 0, loc["shape"][0] if len(loc["shape"]) == 6 else 1)
        with pytest.raises(TransferError):
            client.fetch(_loc(lsock), 3, 3)                            # past the staged blocks
        with pytest.raises(socket.timeout):
            lsock.accept()                                             # nobody connected
    finally:
        lsock.close()
    assert client.stats().refused == 5 and client.stats().rx_alloc_bytes == 0


def test_a_second_tenant_cannot_fetch_or_release_the_first_tenants_transfer(server):
    loc = server.stage(BLOCKS, owner="tenant:a")
    assert loc["id"] != "tenant:a" and len(loc["id"]) == 32
    other = TcpConnector(secret=KEY, timeout=5.0)
    with pytest.raises(TransferError, match="unknown"):
        other.fetch(loc, 0, 5, owner="tenant:b")
    other.release(loc, owner="tenant:b")
    with pytest.raises(TransferError, match="unknown"):
        other.fetch(loc, 0, 5)                                         # no tenant is another owner too
    assert server.num_staged() == 1 and other.stats().rx_alloc_bytes == 0
    assert torch.equal(other.fetch(loc, 0, 5, owner="tenant:a"), BLOCKS)


def test_idle_connections_are_bounded_and_cut_at_the_deadline():
    srv = TcpConnector(secret=KEY, timeout=3.0, workers=1, backlog=0)
    try:
        loc = srv.stage(BLOCKS)
        host, port = srv.serve()
        holder = socket.create_connection((host, port))              # takes the only worker
        _until(lambda: srv._slots._value == 0)
        extra = socket.create_connection((host, port))               # no slot: closed at once
        assert _closed_by_peer(extra, timeout=2.0)
        assert srv.stats().refused == 1
        t0 = time.monotonic()
        try:                                                          # a slow drip does not extend it
            for i in range(len(MAGIC)):
                holder.sendall(MAGIC[i:i + 1])
                time.sleep(0.2)
        except OSError:
            pass
        assert _closed_by_peer(holder, timeout=10.0) and time.monotonic() - t0 < 8.0
        holder.close()
        extra.close()
        _until(lambda: srv._slots._value == 1)
        assert torch.equal(TcpConnector(secret=KEY).fetch(loc, 0, 5), BLOCKS)
    finally:
        srv.close()


def test_a_failed_thread_start_does_not_end_the_accept_loop(server, monkeypatch):
    loc = server.stage(BLOCKS)
    host, port = server.serve()

    def no_thread(*a, **k):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(server, "_dispatch", no_thread)        # handing the connection over fails
    with socket.create_connection((host, port)) as s:
        assert _closed_by_peer(s)
    monkeypatch.undo()
    assert server._thread.is_alive() and server.stats().refused == 1
    assert torch.equal(TcpConnector(secret=KEY).fetch(loc, 0, 5), BLOCKS)


def test_no_listening_or_fetching_beyond_loopback_without_a_secret(tmp_path):
    with pytest.raises(ValueError, match="without a shared secret"):
        TcpConnector(host="0.0.0.0").serve()
    with pytest.raises(ValueError, match="kv_secret_file"):
        EngineArgs(role="prefill", kv_connector="tcp", kv_connector_host="0.0.0.0")
    path = write_secret(tmp_path / "kv.secret")
    EngineArgs(role="prefill", kv_connector="tcp", kv_connector_host="0.0.0.0", kv_secret_file=path)
    assert len(load_secret(path)) == 64
    (tmp_path / "open.secret").write_text("x" * 64)
    (tmp_path / "open.secret").chmod(0o644)
    with pytest.raises(ValueError, match="0600"):
        load_secret(tmp_path / "open.secret")
    loc = {"kind": "tcp", "host": "10.0.0.1", "port": 9, "id": "ab" * 16, "shape": list(SHAPE), "dtype": "float32"}
    with pytest.raises(TransferError, match="no kv secret"):
        TcpConnector().fetch(loc, 0, 5)
