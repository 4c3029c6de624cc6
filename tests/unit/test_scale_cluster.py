"""triton_llm/scale/ray_cluster.py without a Ray cluster: the CPUs each deployment asks for, the
token and loopback settings of a local cluster, the refusal to join a cluster without auth, and
the reaping of what a local cluster left; plus `serve --replicas` refusing before Ray starts."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from triton_llm.scale.app import ScaleConfig
from triton_llm.scale.ray_cluster import (ClusterRefused, check_join, engine_replicas, lock_down_local, reap_local,
                                       remove_token, size_cpus)
from tests.conftest import ROOT


def test_two_replicas_share_a_two_core_host_with_the_ingress():
    cfg = size_cpus(ScaleConfig(model_dir="m", replicas=2), 2.0, None, None)
    assert (cfg.ingress_cpus, cfg.replica_cpus) == (0.5, 0.75)
    assert cfg.ingress_cpus + 2 * cfg.replica_cpus <= 2.0          # Ray can schedule all three
    one = size_cpus(ScaleConfig(model_dir="m", replicas=3), 1.0, None, None)
    assert one.ingress_cpus == 0.25 and one.ingress_cpus + 3 * one.replica_cpus <= 1.0


def test_every_pool_counts_at_its_largest():
    cfg = ScaleConfig(model_dir="m", replicas=1, autoscale=True, min_replicas=1, max_replicas=3,
                      prefill_replicas=1, fallback_model_dir="small", fallback_replicas=2)
    assert engine_replicas(cfg) == 3 + 1 + 2
    sized = size_cpus(cfg, 8.0, None, None)
    assert sized.ingress_cpus + 6 * sized.replica_cpus <= 8.0


def test_cpus_that_do_not_fit_are_refused_at_once_with_what_to_set():
    cfg = ScaleConfig(model_dir="m", replicas=2)
    with pytest.raises(ClusterRefused, match=r"2\.5 Ray CPUs.*has 2.*--replica-cpus to at most 0\.75"):
        size_cpus(cfg, 2.0, 1.0, None)                 # the old default: 2 x 1 + 0.5 > 2
    with pytest.raises(ClusterRefused, match="--ingress-cpus"):
        size_cpus(cfg, 2.0, None, 2.0)                 # nothing left for the replicas
    # a joined cluster may grow (autoscaling): given values are taken as given
    assert size_cpus(cfg, 2.0, 1.0, None, enforce=False).replica_cpus == 1.0


def test_a_local_cluster_gets_a_private_token_and_loopback_only(tmp_path):
    env = {"RAY_AUTH_TOKEN": "someone-elses"}
    d = lock_down_local(env)
    try:
        token = d / "auth_token"
        assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_gcs_server_port_wait_time_s": "120"}
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert len(token.read_text()) == 64
        other = lock_down_local({})
        assert (other / "auth_token").read_text() != token.read_text()     # fresh per run
        remove_token(other)
    finally:
        remove_token(d)
    assert not d.exists()


def test_joining_a_cluster_without_token_auth_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))            # no ~/.ray/auth_token
    with pytest.raises(ClusterRefused, match="without token auth.*--ray-address-insecure"):
        check_join("ray://head:10001", False, {})
    with pytest.raises(ClusterRefused):
        check_join("head:6379", False, {"RAY_AUTH_TOKEN": "t"})            # a token, auth mode not on
    with pytest.raises(ClusterRefused):
        check_join("head:6379", False, {"RAY_AUTH_MODE": "token"})         # auth on, no token
    check_join("head:6379", False, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/run/secrets/ray"})
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    check_join("head:6379", False, {"RAY_AUTH_MODE": "TOKEN"})
    check_join("head:6379", True, {})                                      # said explicitly


def test_reap_ends_what_carries_the_clusters_token_path():
    d = lock_down_local({})
    try:
        env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(d / "auth_token")}
        # a child that ignores SIGTERM, like a stub busy loading: SIGKILL follows
        marked = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                   "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                                   "time.sleep(600)"], env=env, stdout=subprocess.PIPE, text=True)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            assert marked.stdout.readline() == "up\n"
            assert reap_local(d, grace=0.5) == 0
            assert marked.wait(timeout=10) == -9
            assert other.poll() is None                   # not ours to end
        finally:
            for p in (marked, other):
                p.kill()
                p.wait()
    finally:
        remove_token(d)


@pytest.mark.parametrize("args, env, says", [
    (["--host", "0.0.0.0"], {}, "not loopback"),
    ([], {"RAY_ADDRESS": "127.0.0.1:9"}, "without token auth"),
])
def test_serve_replicas_refuses_before_ray_starts(args, env, says):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TRITON_LLM_"))}
    r = subprocess.run([sys.executable, "-m", "triton_llm.cli", "serve", "--model", "nowhere", "--replicas", "2",
                        *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "Ray" not in r.stdout                         # nothing started
