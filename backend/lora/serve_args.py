"""``triton-llm serve --lora NAME=DIR`` (repeatable) -> the engine options that register them."""
from __future__ import annotations

import json
import pathlib


def parse_lora_args(values: list[str]) -> dict[str, str]:
    """NAME=DIR pairs -> {name: absolute dir}; ValueError naming the bad one."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora {v!r}: expected NAME=DIR")
        if name in out:
            raise ValueError(f"--lora {name!r} is given twice")
        if not pathlib.Path(path).is_dir():
            raise ValueError(f"--lora {name}={path}: not a directory")
        out[name] = str(pathlib.Path(path).resolve())
    return out


def lora_engine_options(loras: dict[str, str], options: list[str]) -> list[str]:
    """Add ``lora_modules`` (JSON) and, unless the user set it, ``max_loras`` = the number of
    adapters to the KEY=VALUE engine options."""
    if not loras:
        return list(options)
    keys = {o.split("=", 1)[0].strip() for o in options}
    if "lora_modules" in keys:
        raise ValueError("give adapters either with --lora or with --engine-option lora_modules=..., not both")
    out = [*options, "lora_modules=" + json.dumps(loras)]
    if "max_loras" not in keys:
        out.append(f"max_loras={len(loras)}")
    return out
