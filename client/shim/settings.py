"""Shim settings, the command line of ``python -m client.shim``, and the API-key file."""
from __future__ import annotations

import argparse
import asyncio
import pathlib
from dataclasses import dataclass, field

from client.errors import UnavailableError
from client.shim.limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES,
                                DEFAULT_PROMPT_CHARS_PER_TOKEN)
from client.shim.tenants import KeyPolicy, as_policy, default_tenant, parse_key_entry  # noqa: F401
from common import env
from common.net import is_loopback

KEYS_ENV = "TRITON_LLM_API_KEYS"
INSECURE_ENV = "TRITON_LLM_INSECURE_NO_API_KEYS"   # "1": --insecure-no-api-keys (compose sets it)
ROOT = pathlib.Path(__file__).resolve().parents[2]
# `triton-llm serve` passes its own work directory's chat.sqlite; this is the same file for the
# default work directory (backend/serving/serve.py), so a restart finds the conversations again.
DEFAULT_CHAT_DB = ROOT / "build" / "serve" / "chat.sqlite"


@dataclass
class ShimSettings:
    triton_grpc: str = "127.0.0.1:8001"
    triton_grpc_decode: str | None = None  # set: disaggregated (triton_grpc = prefill server; client/disagg_client.py)
    host: str = "127.0.0.1"
    port: int = 9000
    model_dir: str | None = None
    model_name: str | None = None          # served id; default: the model directory's name
    api_keys_file: str | None = None
    api_keys: dict = field(default_factory=dict)   # key -> tenant name or KeyPolicy (+ load_keys)
    allow_shared_prefix: bool = False      # True: tenants share cached prefixes (no salt sent)
    ensemble: str = "llm"
    engine: str = "engine"
    max_model_len: int | None = None       # default: the server's context window (ContextWindow)
    disconnect_poll_s: float = 0.1         # how often a non-streaming request checks its client
    chat_db_path: str | None = None        # read by the chat page (client/chat): its session store
                                           # (None: in memory; the command line defaults to a file)
    chat_keep_turns: int | None = None     # read by the chat page: default turns kept
    chat_max_conversations: int | None = None  # chat page per-tenant quotas (client/chat/quota.py;
    chat_max_bytes: int | None = None          # None: its defaults, 500 conversations, 32 MiB)
    require_api_keys: bool = False         # refuse to start with no keys (compose, public deployments)
    insecure_no_api_keys: bool = False     # ... unless the operator says so explicitly
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES   # larger request bodies: 413 before parsing
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S # a body still arriving after this: 408
    prompt_chars_per_token: int = DEFAULT_PROMPT_CHARS_PER_TOKEN   # prompt cap: this x the window
    stream_write_timeout_s: float = 30.0   # an SSE client that takes no bytes this long is cut off
    reasoning_parser: str | None = None    # "deepseek_r1": <think> text -> reasoning_content (reasoning.py)
    lora_names: tuple[str, ...] = ()       # model ids that name LoRA adapters of the served model (generation.adapter_for)
    response_store_items: int = 1024       # /v1/responses kept for previous_response_id, per tenant
    response_store_bytes: int = 64 << 20   # ... and their bytes, per tenant (response_store.py)

    served_model: str = field(init=False)   # the model id (model_name, else the checkpoint's name)

    def __post_init__(self) -> None:
        # a field, not a property: read on every request, it runs no code of this file
        self.served_model = self.model_name or (pathlib.Path(self.model_dir).resolve().name if self.model_dir
                                                else self.ensemble)



class ContextWindow:
    """The served context window, asked for once: ``--max-model-len`` when given, else the number
    the server validates against (``client.context_window()``: the engine's own, KV pool clamp
    included, see backend/context.py). Not cached while the server cannot answer."""

    def __init__(self, settings, client) -> None:
        self.client = client
        self._value: int | None = getattr(settings, "max_model_len", None) or None
        self._lock = asyncio.Lock()

    async def get(self) -> int:
        """Raises client.errors.UnavailableError while the server cannot say."""
        if self._value is None:
            async with self._lock:
                if self._value is None:
                    if self.client is None:
                        raise UnavailableError("no server to ask for the context window")
                    self._value = int(await self.client.context_window())
        return self._value


def context_window_of(app, settings=None) -> ContextWindow:
    """The app's one ContextWindow, made on first use from ``settings`` (default
    app.state.settings) and app.state.client."""
    cw = getattr(app.state, "context_window", None)
    if cw is None:
        cw = app.state.context_window = ContextWindow(settings or getattr(app.state, "settings", None),
                                                      getattr(app.state, "client", None))
    return cw


def parse_key_lines(lines) -> dict[str, KeyPolicy]:
    """``KEY[:TENANT] [priority=P] [max_concurrent=N]`` per entry (client/shim/tenants.py); blank
    entries and ``#`` comments are skipped; a bad option raises ValueError."""
    keys: dict[str, KeyPolicy] = {}
    for raw in lines:
        parsed = parse_key_entry(raw)
        if parsed is not None:
            keys[parsed[0]] = parsed[1]
    return keys


class MissingAPIKeys(ValueError):
    """No key configured where keys are needed: ``require_api_keys``, or a ``host`` beyond loopback
    (the shim refuses to start)."""



def load_keys(settings: ShimSettings) -> dict[str, KeyPolicy]:
    """Keys from ``api_keys`` + the key file + env TRITON_LLM_API_KEYS (comma-separated).
    Raises MissingAPIKeys when keys are required, none are given and open mode was not asked for."""
    keys = {k: as_policy(k, v) for k, v in settings.api_keys.items()}
    if settings.api_keys_file:
        keys.update(parse_key_lines(pathlib.Path(settings.api_keys_file).read_text().splitlines()))
    listed = env.raw(KEYS_ENV) or ""
    if listed.strip():
        keys.update(parse_key_lines(listed.split(",")))
    insecure = settings.insecure_no_api_keys or env.flag(INSECURE_ENV)
    if not keys and not insecure and (settings.require_api_keys or not is_loopback(settings.host)):
        why = "" if settings.require_api_keys else f" and --host {settings.host or '(all)'} is not loopback"
        raise MissingAPIKeys(f"no API keys configured{why}: give --api-keys FILE or {KEYS_ENV}=KEY[:TENANT],... "
                             f"(or, to serve without authentication to anyone who reaches the port, "
                             f"--insecure-no-api-keys / {INSECURE_ENV}=1)")
    return keys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.shim",
                                description="OpenAI-compatible HTTP front end for the Triton `llm` ensemble")
    p.add_argument("--triton-grpc", default="127.0.0.1:8001", help="Triton gRPC address HOST:PORT")
    p.add_argument("--triton-grpc-decode", default=None,
                   help="disaggregated serving: the decode server's gRPC HOST:PORT (--triton-grpc is "
                        "then the prefill server; docs/disaggregation.md)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--api-keys", default=None, help=f"file of `KEY[:TENANT] [priority=P] [max_concurrent=N]` lines (also env {KEYS_ENV})")
    p.add_argument("--require-api-keys", action="store_true",
                   help="refuse to start without API keys (unless --insecure-no-api-keys)")
    p.add_argument("--insecure-no-api-keys", action="store_true",
                   help=f"serve without authentication even with --require-api-keys (also env {INSECURE_ENV}=1)")
    p.add_argument("--model-dir", default=None, help="the served checkpoint (its tokenizer counts the chat page's tokens)")
    p.add_argument("--model-name", default=None, help="model id clients send (default: the directory's name)")
    p.add_argument("--allow-shared-prefix", action="store_true",
                   help="let tenants share cached prefixes (default: each tenant's cache is salted)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window to report (default: ask the server)")
    p.add_argument("--chat-db", default=str(DEFAULT_CHAT_DB),
                   help="chat page session store, an SQLite file (':memory:' keeps nothing; default: "
                        "chat.sqlite in triton-llm serve's default work directory, build/serve)")
    p.add_argument("--chat-keep-turns", type=int, default=None, help="chat page: turns kept by default")
    p.add_argument("--chat-max-conversations", type=int, default=None,
                   help="chat page: conversations one tenant may keep (default 500)")
    p.add_argument("--chat-max-bytes", type=int, default=None,
                   help="chat page: bytes of messages one tenant may keep (default 32 MiB)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies are refused with 413 before they are parsed")
    p.add_argument("--prompt-chars-per-token", type=int, default=DEFAULT_PROMPT_CHARS_PER_TOKEN,
                   help="a prompt longer than this many characters per context-window token is a 400 "
                        "before tokenization")
    p.add_argument("--stream-write-timeout", type=float, default=30.0,
                   help="seconds an SSE client may take no bytes before its stream is aborted")
    p.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1",),
                   help="split <think>...</think> into reasoning_content / reasoning items")
    p.add_argument("--lora-name", action="append", default=[],
                   help="a LoRA adapter registered with the engine: requests with this model id use it "
                        "(repeatable; triton-llm serve --lora passes them)")
    p.add_argument("--log-level", default="info")
    return p


def settings_from_args(args: argparse.Namespace) -> ShimSettings:
    return ShimSettings(triton_grpc=args.triton_grpc, triton_grpc_decode=args.triton_grpc_decode, host=args.host, port=args.port,
                        model_dir=args.model_dir, model_name=args.model_name,
                        api_keys_file=args.api_keys, allow_shared_prefix=args.allow_shared_prefix,
                        max_model_len=args.max_model_len, chat_db_path=args.chat_db,
                        chat_keep_turns=args.chat_keep_turns, max_body_bytes=args.max_body_bytes,
                        chat_max_conversations=args.chat_max_conversations,
                        chat_max_bytes=args.chat_max_bytes,
                        prompt_chars_per_token=args.prompt_chars_per_token,
                        stream_write_timeout_s=args.stream_write_timeout,
                        require_api_keys=args.require_api_keys,
                        insecure_no_api_keys=args.insecure_no_api_keys,
                        reasoning_parser=args.reasoning_parser, lora_names=tuple(args.lora_name))
