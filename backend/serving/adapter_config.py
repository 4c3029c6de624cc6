"""What every model.py adapter reads at ``initialize``: its config's parameters and checkpoint directory."""
from __future__ import annotations

import json
import pathlib


def config_parameters(model_config: str | dict) -> dict[str, str]:
    """``parameters`` of a Triton model config (``args["model_config"]``) as key -> string."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    return {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}


def require_model_dir(path: str) -> pathlib.Path:
    """The checkpoint directory named by a config's ``model_dir`` parameter, or a clear error."""
    if not path:
        raise ValueError("parameter model_dir is empty: generate the repository with backend.serving "
                         "(triton-llm serve) or set it in config.pbtxt")
    d = pathlib.Path(path)
    if not (d / "config.json").is_file() or not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"model_dir {str(d)!r} is not a checkpoint directory "
                                "(config.json and tokenizer.json expected)")
    return d
