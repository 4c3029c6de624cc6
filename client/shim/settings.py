"""Shim settings, the command line of ``python -m client.shim``, and the API-key file."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
from dataclasses import dataclass, field

KEYS_ENV = "TRITON_LLM_API_KEYS"


@dataclass
class ShimSettings:
    triton_grpc: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 9000
    model_dir: str | None = None
    model_name: str | None = None          # served id; default: the model directory's name
    api_keys_file: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)   # key -> tenant (filled by load_keys)
    allow_shared_prefix: bool = False      # True: tenants share cached prefixes (no salt sent)
    ensemble: str = "llm"
    engine: str = "engine"
    max_model_len: int | None = None       # default: config.json's max_position_embeddings
    disconnect_poll_s: float = 0.1         # how often a non-streaming request checks its client
    chat_db_path: str | None = None        # read by the chat page (client/chat): its session store
    chat_keep_turns: int | None = None     # read by the chat page: default turns kept

    @property
    def served_model(self) -> str:
        if self.model_name:
            return self.model_name
        if self.model_dir:
            return pathlib.Path(self.model_dir).resolve().name
        return self.ensemble

    def context_window(self) -> int | None:
        if self.max_model_len:
            return self.max_model_len
        if self.model_dir:
            try:
                cfg = json.loads((pathlib.Path(self.model_dir) / "config.json").read_text())
                return int(cfg.get("max_position_embeddings") or 0) or None
            except (OSError, ValueError):
                return None
        return None


def default_tenant(key: str) -> str:
    """A key listed without a tenant is its own tenant; the key itself is never sent."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_key_lines(lines) -> dict[str, str]:
    """``KEY`` or ``KEY:TENANT`` per entry; blank entries and ``#`` comments are skipped."""
    keys: dict[str, str] = {}
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, tenant = line.partition(":")
        key, tenant = key.strip(), tenant.strip()
        if key:
            keys[key] = tenant or default_tenant(key)
    return keys


def load_keys(settings: ShimSettings) -> dict[str, str]:
    """Keys from ``api_keys`` + the key file + env TRITON_LLM_API_KEYS (comma-separated)."""
    keys = dict(settings.api_keys)
    if settings.api_keys_file:
        keys.update(parse_key_lines(pathlib.Path(settings.api_keys_file).read_text().splitlines()))
    env = os.environ.get(KEYS_ENV, "")
    if env.strip():
        keys.update(parse_key_lines(env.split(",")))
    return keys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.shim",
                                description="OpenAI-compatible HTTP front end for the Triton `llm` ensemble")
    p.add_argument("--triton-grpc", default="127.0.0.1:8001", help="Triton gRPC address HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--api-keys", default=None, help=f"file of KEY[:TENANT] lines (also env {KEYS_ENV})")
    p.add_argument("--model-dir", default=None, help="the served checkpoint (config.json for the context size)")
    p.add_argument("--model-name", default=None, help="model id clients send (default: the directory's name)")
    p.add_argument("--allow-shared-prefix", action="store_true",
                   help="let tenants share cached prefixes (default: each tenant's cache is salted)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--chat-db", default=None, help="chat page session store (SQLite file; default: in memory)")
    p.add_argument("--chat-keep-turns", type=int, default=None, help="chat page: turns kept by default")
    p.add_argument("--log-level", default="info")
    return p


def settings_from_args(args: argparse.Namespace) -> ShimSettings:
    return ShimSettings(triton_grpc=args.triton_grpc, host=args.host, port=args.port,
                        model_dir=args.model_dir, model_name=args.model_name,
                        api_keys_file=args.api_keys, allow_shared_prefix=args.allow_shared_prefix,
                        max_model_len=args.max_model_len, chat_db_path=args.chat_db,
                        chat_keep_turns=args.chat_keep_turns)
