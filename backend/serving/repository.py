"""Generate a runnable model repository from the ``model_repository/`` templates.

Each template ``config.pbtxt`` declares every parameter it understands with a default, e.g.::

    parameters: { key: "model_dir" value: { string_value: "" } }

Generating fills ``model_dir`` in every model that declares it, appends every engine option to the
``engine`` model's parameters (engine_parameters.py, from backend/config.py: the template lists none;
an unknown option is an error, so a typo in ``--engine-option`` fails here rather than being
ignored), writes the engine's context window (backend/context.py) into ``preprocessing``'s
``context_window`` so both validate against the same number, writes what the engine's weights will
be (dtype, quantization, bytes: backend/quant/apply.py reported_parameters) into its ``weights_*``
parameters, and optionally changes instance counts.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil

from backend import protocol as P
from backend.config import EngineArgs, option_names
from backend.context import context_window_for
from backend.serving.engine_parameters import engine_parameters

TEMPLATES = pathlib.Path(__file__).resolve().parents[2] / "model_repository"


def _param_pattern(key: str) -> re.Pattern:
    return re.compile(r'(key:\s*"' + re.escape(key) + r'"\s*,?\s*value:\s*\{\s*string_value:\s*)"(?:[^"\\]|\\.)*"')


def declared_parameters(pbtxt: str) -> dict[str, str]:
    """The ``parameters`` of a config.pbtxt as key -> string value."""
    found = re.findall(r'key:\s*"([^"]+)"\s*,?\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', pbtxt)
    return {k: json.loads(f'"{v}"') for k, v in found}


def set_parameter(pbtxt: str, key: str, value: str) -> str:
    """Replace the string value of a declared parameter; KeyError when it is not declared."""
    pattern = _param_pattern(key)
    if not pattern.search(pbtxt):
        raise KeyError(key)
    quoted = json.dumps(str(value), ensure_ascii=False)
    return pattern.sub(lambda m: m.group(1) + quoted, pbtxt, count=1)


def set_instance_count(pbtxt: str, count: int) -> str:
    if count < 1:
        raise ValueError(f"instance count must be >= 1, got {count}")
    new, n = re.subn(r"(instance_group\s*\[\s*\{[^}]*?count:\s*)\d+", lambda m: m.group(1) + str(count), pbtxt)
    if n == 0:
        raise ValueError("config has no instance_group count to change")
    return new


def parse_engine_options(items: list[str] | dict[str, str] | None) -> dict[str, str]:
    """``KEY=VALUE`` strings (or a dict) -> validated engine options (ValueError on a bad one)."""
    if not items:
        return {}
    if isinstance(items, dict):
        opts = {str(k): str(v) for k, v in items.items()}
    else:
        opts = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"engine option {item!r} is not KEY=VALUE")
            opts[key.strip()] = value.strip()
    known = option_names()
    for key in opts:
        if key not in known:
            raise ValueError(f"unknown engine option {key!r}; known: {', '.join(sorted(known))}")
    try:
        EngineArgs.from_dict(opts)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad engine option: {exc}") from None
    return opts


def engine_args(src: pathlib.Path, engine_options: dict[str, str]) -> EngineArgs:
    """The EngineArgs the generated engine model will run with: its template's values + options."""
    declared = declared_parameters((src / P.ENGINE / "config.pbtxt").read_text())
    known = option_names()
    return EngineArgs.from_dict({**{k: v for k, v in declared.items() if k in known}, **engine_options})


def generate_repository(dst: pathlib.Path, model_dir: str | pathlib.Path, *,
                        engine_options: dict[str, str] | None = None,
                        models: list[str] | None = None,
                        instances: dict[str, int] | None = None,
                        src: pathlib.Path = TEMPLATES) -> pathlib.Path:
    """Write the model repository for ``model_dir`` into ``dst`` (replacing what was there)."""
    src = pathlib.Path(src)
    available = sorted(p.name for p in src.iterdir() if (p / "config.pbtxt").exists())
    models = available if models is None else list(models)
    missing = [m for m in models if m not in available]
    if missing:
        raise ValueError(f"no such model template(s) {missing} in {src} (have {available})")
    engine_options = dict(engine_options or {})
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for name in models:
        shutil.copytree(src / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        cfg_path = dst / name / "config.pbtxt"
        cfg = cfg_path.read_text()
        if P.MODEL_DIR in declared_parameters(cfg):
            cfg = set_parameter(cfg, P.MODEL_DIR, str(pathlib.Path(model_dir).resolve()))
        if P.CONTEXT_WINDOW in declared_parameters(cfg):
            window = context_window_for(model_dir, engine_args(src, engine_options).engine)
            cfg = set_parameter(cfg, P.CONTEXT_WINDOW, str(window))
        if name == P.ENGINE:
            if listed := [k for k in declared_parameters(cfg) if k in option_names()]:
                raise ValueError(f"{src / name / 'config.pbtxt'} lists engine options {listed}: they are "
                                 "generated from backend/config.py (backend/serving/engine_parameters.py)")
            cfg = cfg.rstrip("\n") + "\n\n" + engine_parameters(engine_options)
            if P.WEIGHT_BYTES in declared_parameters(cfg):     # what the weights are, for /v1/models
                from backend.quant.plan import reported_parameters
                for key, value in reported_parameters(model_dir, engine_args(src, engine_options).engine).items():
                    cfg = set_parameter(cfg, key, value)
        if instances and name in instances:
            cfg = set_instance_count(cfg, instances[name])
        cfg_path.write_text(cfg)
    return dst
