"""The layers hold: no import circles among the project's modules (function-local imports count:
a local import that hides a circle is still a circle; imports for type checkers only do not),
`backend` imports nothing from `client`, and the engine imports nothing from serving. Read from the source with `ast`, so nothing is
imported to check it."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("backend", "client", "kernels", "common", "triton_llm")
# (importer prefix, imported prefix): a layer may not reach up into another.
FORBIDDEN = [("backend", "client"), ("backend.engine", "backend.serving"),
             ("backend.kv_cache", "backend.serving"), ("backend.model", "backend.serving"),
             ("kernels", "backend"), ("kernels", "client"),
             ("common", "backend"), ("common", "client"), ("common", "kernels"),
             ("backend", "triton_llm"), ("client", "triton_llm"), ("kernels", "triton_llm")]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The project module an import names (a name imported from a package resolves to the
    submodule when there is one, else to the package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports when it runs (function-local imports included,
    ``if TYPE_CHECKING:`` blocks not: they never run)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        type_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                     for stmt in block.body for n in ast.walk(stmt)}     # never runs
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_checker_finds_a_circle_and_a_forbidden_edge():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    graph = import_graph()
    assert "backend.engine.scheduler" in graph["backend.engine.llm_engine"]   # a real edge is seen


def test_the_environment_is_read_in_the_registry_only():
    """os.environ / getenv in product code only in common/env.py (the C kernels read none)."""
    product = [p for pkg in (*PACKAGES, "model_repository") for p in (ROOT / pkg).rglob("*")
               if p.suffix in (".py", ".c") and p != ROOT / "common" / "env.py"]
    readers = sorted(str(p.relative_to(ROOT)) for p in product
                     if any(s in p.read_text(errors="replace") for s in ("os.environ", "getenv(", "os.getenv")))
    assert readers == []


def test_no_import_circles():
    assert circles(import_graph()) == []


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_no_import_reaches_up_a_layer(importer, imported):
    bad = sorted(f"{m} -> {t}" for m, targets in import_graph().items() if m == importer or m.startswith(importer + ".")
                 for t in targets if t == imported or t.startswith(imported + "."))
    assert bad == []


PRODUCT = ("backend", "client", "kernels", "common", "triton_llm", "model_repository")


def _product_files(suffix: str) -> list[pathlib.Path]:
    return [p for pkg in PRODUCT for p in (ROOT / pkg).rglob(f"*{suffix}") if "__pycache__" not in p.parts]


def test_the_lab_stays_outside_the_product():
    """Benchmarks, traces and A/B harnesses live in bench/ and load/, never in a product package."""
    lab = sorted(str(p.relative_to(ROOT)) for p in _product_files(".py")
                 if p.name.startswith("bench") or "trace" in p.name)
    assert lab == []


def test_the_triton_adapters_do_not_edit_sys_path():
    edits = [str(p.relative_to(ROOT)) for p in (ROOT / "model_repository").rglob("model.py")
             if "sys.path" in p.read_text()]
    assert edits == []


@pytest.mark.parametrize("suffix", [".py", ".c", ".h", ".js"])
def test_no_product_source_file_over_320_lines(suffix):
    """Files of one job: Python, the C kernels and the chat page's scripts alike."""
    files = list(_product_files(suffix))
    assert files, suffix      # the walk still finds this kind of file
    long = sorted((str(p.relative_to(ROOT)), n) for p in files
                  if (n := len(p.read_text().splitlines())) > 320)
    assert long == []
