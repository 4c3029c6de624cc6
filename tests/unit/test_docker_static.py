"""docker/ checked without a Docker engine: Dockerfiles parse and copy files that exist (and are not
dockerignored), compose references are consistent, Prometheus targets and Grafana provisioning match
the services, the dashboard JSON is valid."""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import pathlib
import re
import shlex
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "EXPOSE", "ENTRYPOINT", "CMD",
                "HEALTHCHECK", "LABEL", "USER", "VOLUME", "STOPSIGNAL", "SHELL", "ONBUILD"}
COPY_FLAGS = {"--from", "--chown", "--chmod", "--link", "--parents", "--exclude", "--checksum",
              "--keep-git-dir"}
HEALTHCHECK_FLAGS = {"--interval", "--timeout", "--start-period", "--start-interval", "--retries"}


# --- a small Dockerfile parser --------------------------------------------------------------------

def parse_dockerfile(text: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out, buf, start = [], "", 0
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):        # comment lines inside a continuation vanish
            continue
        if not buf:
            start = no
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, args = buf.partition(" ")
        out.append((start, word.upper(), args.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return out


def split_flags(args: str, allowed: set[str]) -> tuple[dict[str, str], str]:
    flags = {}
    while args.startswith("--"):
        flag, _, args = args.partition(" ")
        name, _, value = flag.partition("=")
        assert name in allowed, f"unknown flag {name}"
        flags[name] = value
        args = args.lstrip()
    return flags, args


def exec_form(args: str) -> list[str] | None:
    """The JSON (exec) form of CMD / ENTRYPOINT / COPY, or None for the shell form."""
    if not args.startswith("["):
        return None
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def dockerignore_allows(patterns: list[str], rel: str) -> bool:
    """Docker's rule: the last matching pattern decides; `!` re-includes."""
    allowed = True
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "")) for p in prefixes):
            allowed = negate
    return allowed


def check_dockerfile(path: pathlib.Path, context: pathlib.Path) -> list[tuple[int, str, str]]:
    instrs = parse_dockerfile(path.read_text())
    ignore_file = path.with_name(path.name + ".dockerignore")
    ignore = [ln.strip() for ln in ignore_file.read_text().splitlines()
              if ln.strip() and not ln.startswith("#")] if ignore_file.exists() else []
    pre_from_args, stages, copied_to = set(), [], set()
    for no, word, args in instrs:
        where = f"{path.name}:{no}"
        assert word in INSTRUCTIONS, f"{where}: unknown instruction {word}"
        if not stages:
            assert word in ("ARG", "FROM"), f"{where}: {word} before FROM"
        if word == "ARG" and not stages:
            pre_from_args.add(args.split("=")[0])
        elif word == "FROM":
            for var in re.findall(r"\$\{?(\w+)", args):
                assert var in pre_from_args, f"{where}: FROM uses undeclared ARG {var}"
            toks = args.split()
            stages.append(toks[2].lower() if len(toks) == 3 and toks[1].upper() == "AS" else None)
        elif word in ("COPY", "ADD"):
            flags, rest = split_flags(args, COPY_FLAGS)
            parts = exec_form(rest) or shlex.split(rest)
            assert len(parts) >= 2, f"{where}: {word} needs a source and a destination"
            *sources, dest = parts
            if "--from" in flags:
                assert flags["--from"].lower() in stages, f"{where}: unknown stage {flags['--from']}"
                continue
            for src in sources:
                assert not src.startswith(("/", "..")), f"{where}: source {src} outside the context"
                matches = list(context.glob(src))
                assert matches, f"{where}: {word} source {src} does not exist in {context}"
                assert dockerignore_allows(ignore, src.rstrip("/")), f"{where}: {src} is dockerignored"
            copied_to.add(dest)
        elif word in ("CMD", "ENTRYPOINT"):
            exec_form(args)                       # valid JSON when in exec form
        elif word == "HEALTHCHECK":
            _, rest = split_flags(args, HEALTHCHECK_FLAGS)
            assert rest.split()[0] in ("CMD", "NONE"), f"{where}: HEALTHCHECK needs CMD or NONE"
        elif word == "EXPOSE":
            assert all(re.fullmatch(r"\d+(/(tcp|udp))?", p) for p in args.split()), where
    entry = [a for _, w, a in instrs if w == "ENTRYPOINT"]
    assert entry, f"{path.name}: no ENTRYPOINT"
    script = [a for a in exec_form(entry[-1]) if a.startswith("/usr/local/bin/")]
    assert all(s in copied_to for s in script), f"{path.name}: ENTRYPOINT {script} is never copied"
    return instrs


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_parses_and_copies_existing_files(name):
    instrs = check_dockerfile(DOCKER / name, ROOT)
    words = [w for _, w, _ in instrs]
    assert words.count("FROM") == 1 and "HEALTHCHECK" in words


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_every_package_of_the_project_is_copied(name):
    """`pip install -e .` and the `triton-llm` script need every package pyproject.toml lists (both
    images once lacked common/ and triton_llm/, so `triton-llm --help` failed in the build)."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pat.rstrip("*") for pat in include}
    instrs = parse_dockerfile((DOCKER / name).read_text())
    copied = {shlex.split(a)[0].rstrip("/") for _, w, a in instrs if w == "COPY" and not a.startswith("--")}
    assert packages <= copied, f"{name} does not copy {sorted(packages - copied)}"
    ignore = [ln.strip() for ln in (DOCKER / f"{name}.dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert all(dockerignore_allows(ignore, f"{pkg}/__init__.py") for pkg in packages)


def test_gpu_image_is_ngc_tritonserver_with_cuda_torch():
    instrs = parse_dockerfile((DOCKER / "Dockerfile").read_text())
    args = dict(a.split("=", 1) for _, w, a in instrs if w == "ARG" and "=" in a)
    assert args["TRITON_RELEASE"] == "24.10"
    assert [a for _, w, a in instrs if w == "FROM"] == ["nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3"]
    env = " ".join(a for _, w, a in instrs if w == "ENV")
    assert "TRITONSERVER=/opt/tritonserver/bin/tritonserver" in env
    run = " ".join(a for _, w, a in instrs if w == "RUN")
    assert "--index-url" in run and "whl/cu" in args["TORCH_INDEX_URL"]
    assert "nvidia-pytriton" in run        # the CPU server wheel is filtered out of the GPU image


def test_parser_rejects_bad_dockerfiles(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    bad = {
        "FROM python:3.11\nCOPPY a.txt /a\n": "unknown instruction",
        "FROM python:3.11\nCOPY missing.txt /a\nENTRYPOINT [\"x\"]\n": "does not exist",
        "RUN echo\nFROM python:3.11\n": "before FROM",
        "FROM img:${TAG}\n": "undeclared ARG",
        "FROM python:3.11\nENTRYPOINT [\"x\",\n": None,
    }
    for text, why in bad.items():
        f = tmp_path / "Dockerfile"
        f.write_text(text)
        with pytest.raises((AssertionError, json.JSONDecodeError), match=why):
            check_dockerfile(f, tmp_path)
    (tmp_path / "Dockerfile.dockerignore").write_text("*\n!b.txt\n")
    (tmp_path / "Dockerfile").write_text("FROM x\nCOPY a.txt /a\nENTRYPOINT [\"/a\"]\n")
    with pytest.raises(AssertionError, match="dockerignored"):
        check_dockerfile(tmp_path / "Dockerfile", tmp_path)


def test_entrypoint_is_valid_bash_and_execs_the_launcher():
    script = DOCKER / "entrypoint.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert 'exec triton-llm "${args[@]}"' in text and "--host" in text
    assert script.stat().st_mode & 0o111, "entrypoint.sh must be executable"


# --- compose, Prometheus, Grafana -----------------------------------------------------------------

def expand(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR} with nothing set in the environment."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_references_are_consistent(compose):
    services, volumes = compose["services"], compose.get("volumes") or {}
    assert {"triton", "shim", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            ctx = (DOCKER / svc["build"]["context"]).resolve()
            assert (ctx / svc["build"]["dockerfile"]).is_file(), name
        deps = svc.get("depends_on", [])
        assert set(deps) <= set(services), f"{name} depends on an unknown service"
        for mount in svc.get("volumes", []):
            src = expand(mount).split(":")[0]
            if src.startswith((".", "/")):
                assert (DOCKER / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in volumes, f"{name} uses undeclared volume {src}"
        for port in svc.get("ports", []):
            assert re.fullmatch(r"([\d.]+:)?\d+:\d+", expand(port)), port
        hc = svc.get("healthcheck")
        assert hc and hc["test"][0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
    gpu = services["triton"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and len(gpu["device_ids"]) == 1
    assert services["shim"]["depends_on"]["triton"]["condition"] == "service_healthy"
    assert "triton:8001" in services["shim"]["command"]


def test_prometheus_scrapes_compose_services(compose):
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert "triton:8002" in targets
    for target in targets:
        host, port = target.split(":")
        svc = compose["services"][host]
        container_ports = {expand(p).split(":")[-1] for p in svc.get("ports", [])}
        assert port in container_ports, f"{target}: {host} does not publish {port}"


def load_dashboard_module():
    spec = importlib.util.spec_from_file_location("make_dashboard", DOCKER / "grafana" / "make_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grafana_provisioning_matches_dashboard(compose):
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/dashboards.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    mounts = dict(m.split(":")[:2] for m in compose["services"]["grafana"]["volumes"])
    dash_dir = provider["providers"][0]["options"]["path"]
    assert dash_dir in mounts.values()
    host_dir = DOCKER / next(h for h, c in mounts.items() if c == dash_dir)
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (host_dir / pathlib.Path(home).name).is_file()

    mod = load_dashboard_module()
    committed = json.loads((host_dir / "llm-serving.json").read_text())
    assert committed == mod.dashboard(), "regenerate: python docker/grafana/make_dashboard.py"
    ids = [p["id"] for p in committed["panels"]]
    assert len(ids) == len(set(ids))
    for p in committed["panels"]:
        assert p["datasource"]["uid"] == uid and p["targets"], p["title"]
    titles = " ".join(p["title"].lower() for p in committed["panels"])
    for topic in ("first token", "inter-token", "throughput", "queue", "kv", "prefix", "abort"):
        assert topic in titles
    names = mod.dashboard_metric_names(committed)
    assert names and all(n.startswith("llm_") for n in names), names


def test_promql_metric_name_extraction():
    mod = load_dashboard_module()
    expr = 'sum by (le, model) (rate(a_bucket{x="y("}[1m])) / 1e3 + b offset 5m'
    assert mod.metric_names(expr) == {"a_bucket", "b"}


def test_commands_match_the_real_command_lines(compose):
    """The shim's compose command and the entrypoint's `triton-llm serve` flags parse with the
    project's own argument parsers (so a renamed flag fails here, not in a container)."""
    from triton_llm.cli import build_parser as cli_parser
    from client.shim.settings import build_parser as shim_parser

    shim = compose["services"]["shim"]
    assert shim["entrypoint"] == ["python3", "-m", "client.shim"]
    args = shim_parser().parse_args([expand(a) for a in shim["command"]])
    assert (args.triton_grpc, args.host, args.port, args.model_dir) == ("triton:8001", "0.0.0.0", 9000, "/models")

    text = (DOCKER / "entrypoint.sh").read_text()
    flags = re.findall(r"(--[a-z-]+)[ )]", text[text.index("args=(serve"):text.index('exec triton-llm "${args[@]}"')])
    sample = {"--model": "/m", "--host": "0.0.0.0", "--http-port": "1", "--grpc-port": "2", "--metrics-port": "3",
              "--shim-port": "0", "--workdir": "/w", "--engine-option": "device=cuda", "--api-keys": "/k",
              "--expose-triton": None}
    assert "--model" in flags and set(flags) <= set(sample), flags
    argv = [x for f in sorted(set(flags)) for x in (f, sample[f]) if x is not None]
    ns = cli_parser().parse_args(["serve", *argv])
    assert ns.command == "serve" and ns.engine_option == ["device=cuda"] and ns.expose_triton


# --- no open doors by default -----------------------------------------------------------------

def test_compose_shim_requires_api_keys(compose, tmp_path):
    """The compose shim runs with --require-api-keys: with API_KEYS empty it exits at once with a
    clear error, unless INSECURE_NO_API_KEYS=1 says to serve without authentication."""
    import os
    import sys

    shim = compose["services"]["shim"]
    assert "--require-api-keys" in shim["command"]
    assert shim["environment"]["TRITON_LLM_INSECURE_NO_API_KEYS"] == "${INSECURE_NO_API_KEYS:-0}"
    args = [expand(a) for a in shim["command"]] + ["--chat-db", ":memory:", "--port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_LLM_")}
    env["TRITON_LLM_API_KEYS"] = expand(shim["environment"]["TRITON_LLM_API_KEYS"])
    env["TRITON_LLM_INSECURE_NO_API_KEYS"] = expand(shim["environment"]["TRITON_LLM_INSECURE_NO_API_KEYS"])
    r = subprocess.run([sys.executable, "-m", "client.shim", *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no API keys configured" in r.stderr, r.stderr
    for extra in ({"TRITON_LLM_API_KEYS": "sk-1:acme"}, {"TRITON_LLM_INSECURE_NO_API_KEYS": "1"}):
        proc = subprocess.Popen([sys.executable, "-m", "client.shim", *args], env={**env, **extra},
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            with pytest.raises(subprocess.TimeoutExpired):   # it stays up (serving)
                proc.wait(timeout=8)
        finally:
            proc.kill()
            proc.wait()


def test_entrypoint_refuses_an_open_in_container_shim(tmp_path):
    import os

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "triton-llm").write_text('#!/bin/sh\necho "launcher $*"\n')
    (fake_bin / "triton-llm").chmod(0o755)
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MODEL_DIR": str(model), "SHIM_PORT": "9000"}

    def run(**extra):
        return subprocess.run(["bash", str(DOCKER / "entrypoint.sh")], env={**env, **extra},
                              capture_output=True, text=True, timeout=30)
    r = run()
    assert r.returncode == 2 and "no API keys" in r.stderr
    for extra in ({"INSECURE_NO_API_KEYS": "1"}, {"TRITON_LLM_API_KEYS": "sk-1"},
                  {"API_KEYS_FILE": "/keys"}, {"SHIM_PORT": "0"}):
        r = run(**extra)
        assert r.returncode == 0 and "launcher serve" in r.stdout, (extra, r.stderr)
    assert "--api-keys /keys" in run(API_KEYS_FILE="/keys").stdout


def test_triton_binds_loopback_unless_exposed(compose, tmp_path):
    """The entrypoint passes --expose-triton only for EXPOSE_TRITON=1; compose sets it on purpose
    (its shim is another service) and still publishes Triton's ports on the host's loopback."""
    import os

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "triton-llm").write_text('#!/bin/sh\necho "launcher $*"\n')
    (fake_bin / "triton-llm").chmod(0o755)
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MODEL_DIR": str(model)}
    out = subprocess.run(["bash", str(DOCKER / "entrypoint.sh")], env=env, capture_output=True,
                         text=True, timeout=30).stdout
    assert "--expose-triton" not in out and "--host 0.0.0.0" in out
    out = subprocess.run(["bash", str(DOCKER / "entrypoint.sh")], env={**env, "EXPOSE_TRITON": "1"},
                         capture_output=True, text=True, timeout=30).stdout
    assert "--expose-triton" in out
    assert compose["services"]["triton"]["environment"]["EXPOSE_TRITON"] == "1"


def test_grafana_password_and_triton_ports(compose):
    pw = compose["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert pw.startswith("${GRAFANA_ADMIN_PASSWORD:?"), "no default admin password"
    for port in compose["services"]["triton"]["ports"]:
        assert port.startswith("127.0.0.1:"), f"Triton port {port} must publish on loopback only"
    for name in ("prometheus",):
        assert all(p.startswith("127.0.0.1:") for p in compose["services"][name]["ports"])
