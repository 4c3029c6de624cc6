"""numpy helpers shared by the model.py adapters (which own the pb_utils side)."""
from __future__ import annotations

import json
import pathlib

import numpy as np

from backend.errors import invalid_request


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


def one_string(array: np.ndarray | None, name: str) -> str | None:
    """A BYTES[1] input as text (None when the optional input is absent)."""
    if array is None:
        return None
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise invalid_request(name, f"{name} must hold exactly one string, got shape {list(np.shape(array))}")
    v = flat[0]
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid_request(name, f"{name} is not valid UTF-8") from None
    return str(v)


def string_array(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def int_array(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)
