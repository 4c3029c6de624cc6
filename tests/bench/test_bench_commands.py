"""The lab's commands start: every ``python -m bench.X`` with a command line answers ``--help``, and
the C microbenchmarks in bench/csrc build against this checkout's kernels (a kernel refactor that
breaks them fails here, not in the next person's measurement)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = sorted(p.stem for p in (ROOT / "bench").glob("*.py")
             if "argparse" in (text := p.read_text()) and '__name__ == "__main__"' in text)

# One interpreter for all of them (torch is imported once): each module runs as __main__ with --help.
PROBE = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    sys.argv, out = [name, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
        code = "no exit"
    except SystemExit as exc:
        code = exc.code
    print(name, code, out.getvalue().startswith("usage:"))
"""


def test_every_bench_command_answers_help():
    assert {"ab_dtype_step", "ab_fused_engine", "ab_fused_quant", "ab_fused_step", "profile_steps"} <= set(CLI)
    out = subprocess.run([sys.executable, "-c", PROBE, *CLI], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, check=True)
    assert out.stdout.split("\n")[:-1] == [f"{name} 0 True" for name in CLI], out.stderr[-2000:]


CC = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.parametrize("source, extra", [
    ("cpu_rates.c", []),
    ("ab_fused_bw.c", ["-ldl"]),
    # includes decode_cpu.h and calls the library's linear(): linked with every kernels/csrc source
    ("fused_gemm_bench.c", [*map(str, sorted((ROOT / "kernels" / "csrc").glob("*.c"))), "-lm"]),
])
def test_c_microbenchmarks_build(tmp_path, source, extra):
    cmd = [CC, "-O0", "-march=native", "-fopenmp", "-I.", "-o", str(tmp_path / "a.out"),
           str(ROOT / "bench" / "csrc" / source), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
