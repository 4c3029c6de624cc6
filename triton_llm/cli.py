"""``triton-llm``: the project's command line.

    triton-llm make-model PRESET --out DIR [--seed N]   make a local checkpoint
    triton-llm import-gguf FILE --out DIR [--dtype D]   a llama.cpp GGUF -> a checkpoint dir
    triton-llm serve [--model DIR] [...]                 tritonserver + OpenAI shim
    triton-llm chat [--url HOST:PORT]                    terminal chat over tritonclient gRPC
"""
from __future__ import annotations

import argparse
import sys

# KV pool for `serve` when no kv_cache_memory / num_kv_blocks option is given: 1 GiB holds about
# 23k tokens of SmolLM2-135M in fp32 (46 KB a token), so its full 8,192-token window fits with
# room for a few concurrent conversations, and is small next to this machine's 24 GB.
SERVE_KV_CACHE_MEMORY = 1 << 30


def _cmd_make_model(args: argparse.Namespace) -> int:
    from backend.make_model import make_model

    out = make_model(args.preset, args.out, seed=args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out}")
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from backend.model.gguf_import import import_gguf
    from backend.model.gguf_reader import GGUFError

    try:
        import_gguf(args.file, args.out, dtype=args.dtype, progress=lambda m: print(m, flush=True),
                    keep_quantized=args.keep_quantized)
    except (GGUFError, OSError) as exc:           # a bad file or --out: one line, no traceback
        print(f"import-gguf: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from backend.default_model import ensure_default_model
    from backend.serving.launcher import serve_main

    if args.model is None:
        from backend.model.gguf_reader import GGUFError
        try:
            args.model = str(ensure_default_model())
        except (GGUFError, RuntimeError, OSError) as exc:   # download, hash or import: one line
            print(f"serve: the default model could not be set up: {exc}", file=sys.stderr)
            return 2
    args.engine_option = serve_engine_options(args.engine_option)
    from backend.lora.serve_args import lora_engine_options, parse_lora_args
    try:                                              # LoRA adapters (docs/lora.md)
        args.lora_modules = parse_lora_args(args.lora)
        args.engine_option = lora_engine_options(args.lora_modules, args.engine_option)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "disagg", False):                # prefill/decode disaggregation (docs/disaggregation.md)
        from backend.serving.disagg_serve import serve_disagg
        return serve_disagg(args)
    if getattr(args, "replicas", None):               # scale-out: Ray Serve (triton_llm/scale)
        from triton_llm.scale.run import serve_replicas
        return serve_replicas(args)
    return serve_main(args)


def serve_engine_options(options: list[str]) -> list[str]:
    """The user's KEY=VALUE engine options plus serve's KV budget when they set none, and
    ``dtype=auto`` when they set neither a dtype nor a quantization: bf16 where the CPU has
    AVX512-BF16 or AMX-BF16 (the bf16 fused step is the fastest path there), fp32 elsewhere
    (backend/model/loader.py auto_dtype). int8 / int4 weights keep fp32 (their fused step runs
    fp32 activations). The engine's own default stays fp32, the exactness oracle."""
    keys = {o.split("=", 1)[0].strip() for o in options}
    budget = [] if keys & {"kv_cache_memory", "num_kv_blocks"} else [f"kv_cache_memory={SERVE_KV_CACHE_MEMORY}"]
    return [*options, *budget, *([] if keys & {"dtype", "quantization"} else ["dtype=auto"])]


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

    ig = sub.add_parser("import-gguf", help="convert a llama-family GGUF into a checkpoint directory")
    ig.add_argument("file", help="the .gguf file (llama, mistral or qwen2 architecture)")
    ig.add_argument("--out", required=True, help="checkpoint directory to write: new, empty, or a previous "
                    "import (whose own files are replaced); anything else is refused")
    ig.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="dtype of the dequantized weights (default float32: exact)")
    ig.add_argument("--keep-quantized", action="store_true",
                    help="keep Q8_0/Q4_0/Q4_1 layer weights packed (int8/int4, docs/quantization.md)")
    ig.set_defaults(func=_cmd_import_gguf)

    sv = sub.add_parser("serve", help="start tritonserver on the model repository and the OpenAI shim")
    sv.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct in "
                    "models/default, fetched and imported on first use)")
    sv.add_argument("--host", default="127.0.0.1", help="address for the OpenAI shim (Triton stays on loopback)")
    sv.add_argument("--expose-triton", action="store_true",
                    help="bind Triton's HTTP/gRPC/metrics ports to --host too: they have no API keys, so "
                         "only on a trusted network (docs/serving.md, trust model)")
    sv.add_argument("--http-port", type=int, default=8000)
    sv.add_argument("--grpc-port", type=int, default=8001)
    sv.add_argument("--metrics-port", type=int, default=8002)
    sv.add_argument("--shim-port", type=int, default=9000, help="OpenAI-compatible HTTP port (0 = no shim)")
    sv.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option (backend/config.py; all in docs/reference.md), repeatable")
    sv.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                    help="serve a PEFT LoRA adapter under the model id NAME, repeatable (docs/lora.md)")
    sv.add_argument("--api-keys", default=None, help="file of API keys for the shim (KEY[:TENANT] per line)")
    sv.add_argument("--insecure-no-api-keys", action="store_true",
                    help="let the shim serve without API keys on a --host beyond loopback (it refuses "
                         "otherwise): anyone who reaches the port uses the model")
    sv.add_argument("--workdir", default=None, help="where the generated model repository and logs go")
    from triton_llm.scale.run import add_arguments as add_scale_arguments
    add_scale_arguments(sv)
    from backend.serving.disagg_serve import add_arguments as add_disagg_arguments
    add_disagg_arguments(sv)
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
