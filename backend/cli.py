"""``triton-llm``: the project's command line.

    triton-llm make-model PRESET --out DIR [--seed N]   make a local checkpoint
    triton-llm serve [--model DIR] [...]                 tritonserver + OpenAI shim
    triton-llm chat [--url HOST:PORT]                    terminal chat over tritonclient gRPC
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = ROOT / "models" / "default"
DEFAULT_PRESET = "tiny"


def ensure_default_model() -> pathlib.Path:
    """The bundled demo model: made from the default preset on first use."""
    from backend.make_model import make_model

    if not (DEFAULT_MODEL_DIR / "model.safetensors").exists():
        print(f"[triton-llm] making the default model ({DEFAULT_PRESET}) in {DEFAULT_MODEL_DIR}", flush=True)
        make_model(DEFAULT_PRESET, DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR


def _cmd_make_model(args: argparse.Namespace) -> int:
    from backend.make_model import make_model

    out = make_model(args.preset, args.out, seed=args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from backend.serving.launcher import serve_main

    if args.model is None:
        args.model = str(ensure_default_model())
    return serve_main(args)


def _cmd_chat(args: argparse.Namespace) -> int:
    from client.chat_cli import chat_main

    return chat_main(args)


def build_parser() -> argparse.ArgumentParser:
    from backend.make_model import PRESETS

    p = argparse.ArgumentParser(prog="triton-llm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="create a local checkpoint from a preset")
    mm.add_argument("preset", choices=sorted(PRESETS))
    mm.add_argument("--out", required=True)
    mm.add_argument("--seed", type=int, default=0)
    mm.set_defaults(func=_cmd_make_model)

    sv = sub.add_parser("serve", help="start tritonserver on the model repository and the OpenAI shim")
    sv.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: bundled demo model)")
    sv.add_argument("--host", default="127.0.0.1", help="address for Triton's ports and the shim")
    sv.add_argument("--http-port", type=int, default=8000)
    sv.add_argument("--grpc-port", type=int, default=8001)
    sv.add_argument("--metrics-port", type=int, default=8002)
    sv.add_argument("--shim-port", type=int, default=9000, help="OpenAI-compatible HTTP port (0 = no shim)")
    sv.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option (see backend/config.py EngineArgs), repeatable")
    sv.add_argument("--api-keys", default=None, help="file of API keys for the shim (KEY[:TENANT] per line)")
    sv.add_argument("--workdir", default=None, help="where the generated model repository and logs go")
    sv.set_defaults(func=_cmd_serve)

    ch = sub.add_parser("chat", help="terminal chat that streams from the ensemble")
    ch.add_argument("--url", default="127.0.0.1:8001")
    ch.add_argument("--model-name", default="llm")
    ch.add_argument("--max-tokens", type=int, default=256)
    ch.set_defaults(func=_cmd_chat)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
