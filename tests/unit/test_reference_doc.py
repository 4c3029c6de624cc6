"""docs/reference.md against the code: every engine option, environment variable, metric and CLI
flag the code has is on the page, and the page names nothing the code lacks. The code is the truth;
when one of these fails, run ``python scripts/gen_reference.py`` and commit the page."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference.md"
HINT = "docs/reference.md is stale: run `python scripts/gen_reference.py`"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


def _page_sections() -> dict[str, set[str]]:
    """heading (## or ###) -> the first-column names of its table rows."""
    sections: dict[str, set[str]] = {}
    heading = None
    for line in PAGE.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip().strip("`")
            sections.setdefault(heading, set())
        m = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if m and heading is not None:
            sections[heading].add(m.group(1))
    return sections


@pytest.fixture(scope="module")
def page():
    return _page_sections()


def _diff(code: set[str], page: set[str]) -> str:
    return f"{HINT}\n  in the code, not on the page: {sorted(code - page)}\n  on the page, not in the code: {sorted(page - code)}"


def test_every_engine_option_and_no_other(page):
    code = {name for _, name, *_ in gen.engine_options()}
    on_page = set().union(*(names for h, names in page.items() if h == "Engine options" or
                            h in {p for p, *_ in gen.engine_options() if p}))
    assert "kv_cache_memory" in code and "max_num_seqs" in code
    assert code == on_page, _diff(code, on_page)


def test_every_environment_variable_and_no_other(page):
    code = {name for name, *_ in gen.env_vars()}
    assert "TRITON_LLM_API_KEYS" in code
    assert code == page["Environment variables"], _diff(code, page["Environment variables"])


def test_every_metric_and_no_other(page):
    code = {name for name, *_ in gen.metrics()}
    assert code == page["Metrics"], _diff(code, page["Metrics"])


def test_every_command_line_flag_and_no_other(page):
    for cmd, rows in gen.command_lines().items():
        code = {name for name, *_ in rows}
        assert cmd in page, f"{HINT}: no section for {cmd}"
        assert code == page[cmd], f"{cmd}: " + _diff(code, page[cmd])
    assert {"triton-llm serve", "python -m client.shim"} <= set(gen.command_lines())


def test_the_metric_scan_finds_every_name_of_the_serving_tables():
    # The scan is the page's source; it must see what the serving metrics module registers.
    from backend.serving import metrics as m
    found = {name for name, *_ in gen.metrics()}
    registered = set(m.HISTOGRAMS) | set(m.GAUGES) | set(m.STAT_COUNTERS) | {m.FINISHED, m.REJECTED}
    assert registered <= found, sorted(registered - found)


def test_the_env_scan_sees_each_way_of_reading_and_skips_writes(tmp_path):
    py = tmp_path / "reads.py"
    py.write_text(
        "import os\nfrom os import environ, getenv\n"
        "NAME = 'A_CONST'\nLIMIT = 7\n"
        "a = os.environ.get(NAME, LIMIT)\n"
        "b = os.environ['B_SUBSCRIPT']\n"
        "c = os.getenv('C_GETENV', 'x')\n"
        "d = 'D_IN' in os.environ\n"
        "e = environ.get('E_BARE')\n"
        "f = getenv('F_BARE')\n"
        "os.environ['W_WRITTEN'] = '1'\n"
        "child = {'TRITON_LLM_FOR_A_CHILD': '1'}\n"
        "g = env_int('G_REGISTRY', 3, doc='read through a registry')\n")
    docs: dict[str, str] = {}
    reads = gen.env_reads(py, docs)
    assert reads == {"A_CONST": 7, "B_SUBSCRIPT": None, "C_GETENV": "x", "D_IN": None, "E_BARE": None,
                     "F_BARE": None, "TRITON_LLM_FOR_A_CHILD": None, "G_REGISTRY": 3}
    assert docs == {"G_REGISTRY": "read through a registry"}
    c = tmp_path / "k.c"
    c.write_text('const char *e = getenv("K_FROM_C");\n')
    assert gen.env_reads(c) == {"K_FROM_C": None}


def test_an_option_comment_becomes_its_meaning():
    from dataclasses import dataclass

    @dataclass
    class Opts:
        alpha: int = 1                 # the first
                                       # and its second line
        # a group heading, not alpha's
        beta: float = 0.5

    comments = gen._field_comments(Opts)
    assert comments == {"alpha": "the first and its second line", "beta": ""}
