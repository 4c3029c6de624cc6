"""Write docs/reference.md from the code: engine options, environment variables, metrics, CLI flags.

    python scripts/gen_reference.py            # rewrite docs/reference.md
    python scripts/gen_reference.py --check    # exit 1 if the page differs from what the code says

Every list is read from the code, so a new option, variable or metric appears here without an edit:
- engine options: the leaf fields of ``backend.config.EngineArgs`` (nested dataclass parts are
  walked), their defaults, and the comment beside each field in the source;
- environment variables: the registry's table (``common/env.py`` ``VARS``: name, default, doc) with
  the files that name each, plus every other ``os.environ`` / ``environ`` / ``getenv`` read (names
  resolved through module constants) in every top-level code folder, every ``getenv("...")`` in C,
  and every ``TRITON_LLM_*`` string constant (variables set for a child process are read there);
- metrics: every metric name defined with its help text (a ``counter``/``gauge``/``histogram`` call
  or a ``{name: doc}`` table);
- command lines: the argparse parsers of ``triton-llm`` and ``python -m client.shim``.
Only the one-line meanings that the code does not carry come from ``NOTES`` below.
tests/unit/test_reference_doc.py fails when the page and the code disagree.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import pathlib
import re
import sys
import typing

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"
LAB_DIRS = ("bench", "load", "scripts")
NOT_CODE = {"tests", "docs", "build", "models", "docker"}
# every top-level folder of code: a new package is scanned without an edit here
CODE_DIRS = tuple(sorted(d.name for d in ROOT.iterdir() if d.is_dir() and d.name not in NOT_CODE
                         and not d.name.startswith(".") and not d.name.endswith(".egg-info")))
ENV_DIRS = CODE_DIRS
METRIC_DIRS = tuple(d for d in CODE_DIRS if d not in LAB_DIRS)
REGISTRY = "common.env"          # the product's table of environment variables (VARS), when present
SELF = pathlib.Path(__file__).resolve()
PROJECT_ENV = re.compile(r"TRITON_LLM_[A-Z0-9_]+")
ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
METRIC = re.compile(r"(triton_)?llm_[a-z0-9_]+")
C_GETENV = re.compile(r'getenv\(\s*"([A-Za-z_][A-Za-z0-9_]*)"\s*\)')

# Meanings the code does not state next to the name (an option without a comment or whose comment
# does not read alone, a lab variable outside the registry, a flag without help: "COMMAND FLAG").
# A name here that the code no longer has is simply not written.
NOTES = {
    "LLM_TTFT_TRACE": "folder: record first-token timestamps per process (lab trace)",
    "LLM_PATH_TRACE": "folder: note the files each process runs code from while `<folder>/on` exists",
    "PYTHONPATH": "with bench/attach on it, the lab serves the checkout it names (`overhead_ab NAME@tree=DIR`)",
    "OUT": "gpu_check.py writes its logs under $OUT/gpu_check",
    "TMPDIR": "gpu_check.py builds its 200 MB checkpoint here",
    "triton-llm make-model preset": "the shape preset (backend/make_model.py PRESETS)",
    "triton-llm make-model --out": "checkpoint directory to write",
    "triton-llm make-model --seed": "seed of the random weights",
    "triton-llm serve --http-port": "Triton's HTTP port",
    "triton-llm serve --grpc-port": "Triton's gRPC port",
    "triton-llm serve --metrics-port": "Triton's metrics port (/metrics)",
    "triton-llm chat --url": "Triton gRPC address HOST:PORT",
    "triton-llm chat --model-name": "the model to stream from (the llm ensemble)",
    "triton-llm chat --max-tokens": "max tokens per reply",
    "python -m client.shim --host": "address the shim binds",
    "python -m client.shim --port": "the shim's HTTP port",
    "python -m client.shim --log-level": "uvicorn and logging level",
}


def _md(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _rel(path: pathlib.Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()


# -- engine options ---------------------------------------------------------------------------
def _field_comments(cls) -> dict[str, str]:
    """field name -> its comment: the one on its line plus comment-only lines indented past the
    fields (continuations); a comment at the fields' own indent starts a group and is not kept."""
    src = inspect.getsource(cls)
    out: dict[str, str] = {}
    current, indent = None, None
    for line in src.splitlines()[1:]:
        m = re.match(r"(\s*)([A-Za-z_]\w*)\s*:[^#]*?(?:#\s?(.*))?$", line)
        stripped = line.lstrip()
        if m and not stripped.startswith(("#", "def ", "@")):
            indent = indent or len(m.group(1))
            current = m.group(2)
            out[current] = (m.group(3) or "").strip()
        elif stripped.startswith("#") and current and indent is not None and len(line) - len(stripped) > indent:
            out[current] = f"{out[current]} {stripped.lstrip('#').strip()}".strip()
        else:
            current = None
    return out


def _leaf_fields(cls, part: str = ""):
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        typ = hints.get(f.name)
        if dataclasses.is_dataclass(typ):               # a part of the config: its fields are the options
            yield from _leaf_fields(typ, typ.__name__)
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        yield part, f.name, str(f.type), default, NOTES.get(f.name) or comments.get(f.name, "")


def _default_text(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, str) and value.startswith(str(ROOT) + "/"):
        value = value[len(str(ROOT)) + 1:]                  # a path in the checkout: relative
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return repr(value) if isinstance(value, str) else str(value)


def engine_options() -> list[tuple]:
    """(part, name, type, default text, meaning) for every option EngineArgs takes."""
    from backend.config import EngineArgs
    return [(p, n, t, _default_text(d), m) for p, n, t, d, m in _leaf_fields(EngineArgs)]


# -- environment variables --------------------------------------------------------------------
def _source_files(dirs, suffixes):
    for d in dirs:
        base = ROOT / d
        if base.is_dir():
            for p in sorted(base.rglob("*")):
                if p.suffix in suffixes and p.resolve() != SELF and "__pycache__" not in p.parts:
                    yield p


def _constants(tree: ast.Module) -> dict[str, object]:
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def _value(node, consts):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    return None


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id in ("environ", "env_map"))


def _is_env_helper(fn) -> bool:
    """A registry-style reader or declaration: a call whose name says env (env_int, EnvVar, ...)."""
    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
    return "env" in name.lower() and name not in ("getenv",)


def env_reads(path: pathlib.Path, docs: dict[str, str] | None = None) -> dict[str, object]:
    """name -> default (None when not given) of every variable one file reads; a registry's help
    text (a ``doc``/``help`` keyword of the declaring call) goes into ``docs``."""
    found: dict[str, object] = {}
    if path.suffix != ".py":
        text = path.read_text(errors="replace")
        for name in C_GETENV.findall(text) + re.findall(r'"(TRITON_LLM_[A-Z0-9_]+)"', text):
            found.setdefault(name, None)
        return found
    tree = ast.parse(path.read_text())
    consts = _constants(tree)
    for node in ast.walk(tree):
        name, default = None, None
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            if (isinstance(fn, ast.Attribute) and fn.attr == "get" and _is_environ(fn.value)) or \
                    (isinstance(fn, ast.Attribute) and fn.attr == "getenv") or \
                    (isinstance(fn, ast.Name) and fn.id == "getenv"):
                name = _value(node.args[0], consts)
                default = _value(node.args[1], consts) if len(node.args) > 1 else None
            elif _is_env_helper(fn) and isinstance(_value(node.args[0], consts), str) and \
                    ENV_NAME.fullmatch(_value(node.args[0], consts)):
                name = _value(node.args[0], consts)
                kw = {k.arg: _value(k.value, consts) for k in node.keywords}
                default = kw.get("default", _value(node.args[1], consts) if len(node.args) > 1 else None)
                doc = next((kw[k] for k in ("doc", "help", "meaning", "description") if isinstance(kw.get(k), str)), None)
                if doc and docs is not None:
                    docs[name] = doc
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            name = _value(node.slice, consts)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            name = _value(node.left, consts)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PROJECT_ENV.fullmatch(node.value):
            name = node.value
        if isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and found.get(name) is None:
            found[name] = default
    return found


def _registry() -> dict[str, tuple[object, str]]:
    """name -> (default, doc) from the product's environment registry, {} when there is none."""
    import importlib
    try:
        mod = importlib.import_module(REGISTRY)
    except ImportError:
        return {}
    return {name: (getattr(v, "default", None), getattr(v, "doc", "")) for name, v in getattr(mod, "VARS", {}).items()}


def _literal_uses(names: set[str]) -> tuple[dict[str, list[str]], dict[str, object]]:
    """(name -> the files whose code names it, where a registry variable is read; name -> the
    default its reader passes, e.g. ``env.integer(NAME, MAX_TOKENS)``)."""
    uses: dict[str, list[str]] = {n: [] for n in names}
    defaults: dict[str, object] = {}
    registry_file = ROOT / (REGISTRY.replace(".", "/") + ".py")
    for path in _source_files(ENV_DIRS, {".py"}):
        if path.resolve() == registry_file.resolve():
            continue
        tree = ast.parse(path.read_text())
        consts = _constants(tree)
        found = set()
        for n in ast.walk(tree):
            v = _value(n, consts) if isinstance(n, (ast.Constant, ast.Name)) else None
            if isinstance(v, str) and v in names:
                found.add(v)
            if isinstance(n, ast.Call) and len(n.args) > 1 and _value(n.args[0], consts) in names:
                defaults.setdefault(_value(n.args[0], consts), _value(n.args[1], consts))
        for v in found:
            uses[v].append(_rel(path))
    return uses, defaults


def env_vars() -> list[tuple]:
    """(name, default text, files, meaning), sorted by name: the registry's variables (where each is
    named) and every other read the scan finds (the lab's, a read that bypasses the registry)."""
    table: dict[str, tuple[object, list[str]]] = {}
    docs: dict[str, str] = {}
    registry = _registry()
    uses, reader_defaults = _literal_uses(set(registry))
    for name, (default, doc) in registry.items():
        default = default if default is not None else reader_defaults.get(name)
        table[name] = (default, uses[name] or [REGISTRY.replace(".", "/") + ".py"])
        docs[name] = doc
    for path in _source_files(ENV_DIRS, {".py", ".c", ".h", ".cpp", ".cu"}):
        for name, default in env_reads(path, docs).items():
            if name in registry:
                continue
            d, files = table.setdefault(name, (None, []))
            files.append(_rel(path))
            if d is None and default is not None:
                table[name] = (default, files)
    return [(n, "–" if d is None else repr(d), files, docs.get(n) or NOTES.get(n, ""))
            for n, (d, files) in sorted(table.items())]


# -- metrics ----------------------------------------------------------------------------------
_KINDS = {"counter": "counter", "rcounter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary",
          "histograms": "histogram", "gauges": "gauge", "counters": "counter", "stat_counters": "counter"}


def metric_defs(path: pathlib.Path) -> dict[str, tuple[str, str, list[str]]]:
    """name -> (kind, help text, label names) for every metric one Python file defines."""
    tree = ast.parse(path.read_text())
    consts = _constants(tree)
    out: dict[str, tuple[str, str, list[str]]] = {}
    label_vars = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
                  for t in n.targets if isinstance(t, ast.Name)}    # e.g. lab = {**labels, "role": ...}

    def label_keys(d) -> list[str]:
        keys = []
        for k, v in zip(d.keys, d.values):
            if isinstance(k, ast.Constant):
                keys.append(k.value)
            elif k is None and isinstance(v, ast.Name) and v.id in label_vars:
                keys += label_keys(label_vars[v.id])
        return keys

    def add(name, doc, kind, labels=(), constructor=False):
        # a known metric constructor may use any name; elsewhere only our llm_ prefixes count
        ok = re.fullmatch(r"[a-z_][a-z0-9_]*", name) if constructor and isinstance(name, str) else \
            isinstance(name, str) and METRIC.fullmatch(name)
        if ok and isinstance(doc, str):
            kind = kind or ("counter" if name.endswith("_total") else "gauge")
            out.setdefault(name, (kind, doc, sorted(labels)))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            fn = node.func
            fname = (fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")).lower()
            labels = []
            for a in list(node.args[2:3]) + [k.value for k in node.keywords if k.arg in ("labels", "tag_keys")]:
                if isinstance(a, ast.Name) and a.id in label_vars:
                    a = label_vars[a.id]
                if isinstance(a, ast.Dict):
                    labels += label_keys(a)
                elif isinstance(a, (ast.Tuple, ast.List)):
                    labels += [e.value for e in a.elts if isinstance(e, ast.Constant)]
            add(_value(node.args[0], consts), _value(node.args[1], consts), _KINDS.get(fname), labels,
                constructor=fname in _KINDS)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            kind = _KINDS.get(getattr(target, "id", "").lower())
            for k, v in zip(node.value.keys, node.value.values):
                doc = v.elts[0] if isinstance(v, ast.Tuple) and v.elts else v
                add(_value(k, consts) if k is not None else None, _value(doc, consts), kind)
    return out


def metrics() -> list[tuple]:
    """(name, kind, labels, file, help) sorted by name."""
    rows = {}
    for path in _source_files(METRIC_DIRS, {".py"}):
        for name, (kind, doc, labels) in metric_defs(path).items():
            rows.setdefault(name, (name, kind, labels, _rel(path), doc))
    return [rows[n] for n in sorted(rows)]


# -- command lines ----------------------------------------------------------------------------
def _flags(cmd: str, parser: argparse.ArgumentParser) -> list[tuple]:
    rows = []
    for a in parser._actions:                       # argparse keeps no public list of its actions
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(a.option_strings) or a.dest
        default = "–" if a.default in (None, argparse.SUPPRESS) or a.required else _default_text(a.default)
        if isinstance(a, argparse._StoreTrueAction):
            default = "off"
        rows.append((name, default, a.help or NOTES.get(f"{cmd} {(a.option_strings or [a.dest])[0]}", "")))
    return rows


def command_lines() -> dict[str, list[tuple]]:
    """'triton-llm SUB' / 'python -m client.shim' -> (flag, default, meaning) rows."""
    from triton_llm.cli import build_parser
    from client.shim.settings import build_parser as shim_parser
    out = {}
    for a in build_parser()._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, p in a.choices.items():
                out[f"triton-llm {sub}"] = _flags(f"triton-llm {sub}", p)
    out["python -m client.shim"] = _flags("python -m client.shim", shim_parser())
    return out


# -- the page ---------------------------------------------------------------------------------
def render() -> str:
    lines = ["# Reference", "",
             "Generated from the code by `python scripts/gen_reference.py` (do not edit by hand: change the",
             "comment or help text in the code and re-run it); `tests/unit/test_reference_doc.py` fails when",
             "this page and the code disagree.", "",
             "## Engine options", "",
             "`backend/config.py`: one dataclass per concern (the parts below; each consumer takes its part),",
             "one flat set of names. Give them as `--engine-option KEY=VALUE` to `triton-llm serve`",
             "(repeatable), as keyword arguments of `LLM(...)`, or as `parameters` of the engine model's",
             "`config.pbtxt`, which the generated repository lists in full (`backend/serving/engine_parameters.py`;",
             "strings, parsed by `EngineArgs.from_dict`; booleans: `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`).",
             ""]
    part = None
    for p, name, typ, default, meaning in engine_options():
        if p != part or part is None:
            if p:
                lines += ([""] if lines[-1] else []) + [f"### {p}", ""]
            lines += ["| option | type | default | meaning |", "|---|---|---|---|"]
            part = p
        lines.append(f"| `{name}` | {_md(typ)} | {_md(default)} | {_md(meaning)} |")
    lines += ["", "## Environment variables", "",
              "The product's variables are declared in `common/env.py` (the one module that reads them);",
              "the lab's (`bench/`, `load/`, `scripts/`) are found where they are read. Default:",
              "what the code assumes when unset; read in: the files that name it.", "",
              "| variable | default | read in | meaning |", "|---|---|---|---|"]
    for name, default, files, meaning in env_vars():
        where = ", ".join(f"`{f}`" for f in files)
        lines.append(f"| `{name}` | {_md(default)} | {where} | {_md(meaning)} |")
    lines += ["", "## Metrics", "",
              "The engine model's metrics are on Triton's metrics port (`/metrics`, 8002 by default) next to",
              "Triton's own `nv_*` families; every series carries the model's `model` / `version` labels.",
              "The scale-out router's (`triton_llm_*`) go through Ray's metrics export."]
    rows = metrics()
    if not any(where.startswith("client/") for _, _, _, where, _ in rows):
        lines.append("The shim exports no metrics of its own (its requests are counted by the engine's).")
    lines += ["",
              "| metric | type | labels | defined in | meaning |", "|---|---|---|---|---|"]
    for name, kind, labels, where, doc in rows:
        lab = ", ".join(f"`{x}`" for x in labels) or "–"
        lines.append(f"| `{name}` | {kind} | {lab} | `{where}` | {_md(doc)} |")
    lines += ["", "## Command lines", ""]
    for cmd, rows in command_lines().items():
        lines += [f"### `{cmd}`", "", "| flag | default | meaning |", "|---|---|---|"]
        lines += [f"| `{n}` | {_md(d)} | {_md(m)} |" for n, d, m in rows]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md is not current")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        print("docs/reference.md is current" if current == text else "docs/reference.md is stale")
        return 0 if current == text else 1
    PAGE.write_text(text)
    print(f"wrote {_rel(PAGE)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
