"""``triton-llm chat``: a terminal chat over the ``llm`` ensemble (tritonclient gRPC streaming).

Keeps the conversation, streams each answer, and on Ctrl-C during an answer stops it -- stream
cancel plus explicit abort, waited for -- keeps the partial answer in the history and returns to
the prompt. Ctrl-C or Ctrl-D at the prompt quits. Commands: ``/reset``, ``/system TEXT``, ``/quit``.
"""
from __future__ import annotations

import sys
from typing import TextIO

from client.errors import TritonLLMError
from client.sync_client import SyncTritonLLMClient

HELP = "commands: /reset (new conversation), /system TEXT (set the system prompt), /quit"


def chat_turn(client: SyncTritonLLMClient, messages: list[dict], *, max_tokens: int,
              out: TextIO) -> tuple[str, str | None]:
    """Stream one answer to ``out``; returns (text, finish_reason). Ctrl-C -> finish "interrupted"."""
    parts: list[str] = []
    finish = None
    try:
        for chunk in client.generate(messages=messages, params={"max_tokens": max_tokens}):
            if chunk.text:
                parts.append(chunk.text)
                out.write(chunk.text)
                out.flush()
            finish = chunk.finish_reason or finish
    except KeyboardInterrupt:                   # the generator's cleanup already aborted it
        finish = "interrupted"
    return "".join(parts), finish


def run_chat(client: SyncTritonLLMClient, *, max_tokens: int, inp: TextIO = sys.stdin,
             out: TextIO = sys.stdout) -> int:
    system: str | None = None
    history: list[dict] = []
    out.write(f"[triton-llm chat] {HELP}; Ctrl-C stops an answer\n")
    while True:
        try:
            out.write("\n> ")
            out.flush()
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        if not line:                            # EOF
            out.write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history.clear()
            out.write("(new conversation)\n")
            continue
        if line.startswith("/system"):
            system = line[len("/system"):].strip() or None
            out.write(f"(system prompt {'set' if system else 'cleared'})\n")
            continue
        if line.startswith("/"):
            out.write(HELP + "\n")
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        try:
            text, finish = chat_turn(client, messages, max_tokens=max_tokens, out=out)
        except TritonLLMError as exc:
            history.pop()
            out.write(f"\n[error {exc.status}] {exc.message}\n")
            continue
        history.append({"role": "assistant", "content": text})
        if finish == "interrupted":
            out.write("\n[stopped]\n")
        elif finish == "length":
            out.write("\n[cut at max_tokens]\n")
        else:
            out.write("\n")


def chat_main(args) -> int:
    """Entry point of ``triton-llm chat`` (args: url, model_name, max_tokens)."""
    client = SyncTritonLLMClient(args.url, ensemble=getattr(args, "model_name", "llm") or "llm")
    try:
        if not client.is_ready():
            print(f"[triton-llm chat] Triton at {args.url} or model "
                  f"{getattr(args, 'model_name', 'llm')!r} is not ready", file=sys.stderr)
            return 1
        return run_chat(client, max_tokens=int(args.max_tokens))
    finally:
        client.close()
