"""docker/kuberay/rayservice.yaml checked offline: a RayService whose Serve config builds with our
app builder's fields, one engine per GPU, drains before pods go, Ray's control plane behind a token
and a NetworkPolicy, non-root pods, and the CLI's --replicas flags."""
from __future__ import annotations

import dataclasses
import importlib
import pathlib

import pytest
import yaml

from triton_llm.scale.app import ScaleConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "docker" / "kuberay" / "rayservice.yaml"


RAY_CONTROL_PORTS = (6379, 8265, 10001)       # GCS, dashboard / Jobs API, Ray Client


def _docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def _load():
    doc = _docs()["RayService"]
    return doc, yaml.safe_load(doc["spec"]["serveConfigV2"])


def _pod_specs(doc) -> list[dict]:
    rc = doc["spec"]["rayClusterConfig"]
    return [rc["headGroupSpec"]["template"]] + [w["template"] for w in rc["workerGroupSpecs"]]


def test_rayservice_serves_our_app_builder_with_valid_args():
    doc, serve_cfg = _load()
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    (app,) = serve_cfg["applications"]
    module, attr = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    fields = {f.name for f in dataclasses.fields(ScaleConfig)}
    assert set(app["args"]) <= fields, set(app["args"]) - fields
    ScaleConfig(**app["args"])                                   # constructs
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == _pinned("ray[serve]")


def test_one_engine_per_gpu_and_graceful_termination():
    doc, serve_cfg = _load()
    args = serve_cfg["applications"][0]["args"]
    (workers,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = workers["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 == args["replica_gpus"]
    assert workers["rayStartParams"]["num-gpus"] == "1"
    engines = args["max_replicas"] + (args.get("fallback_replicas", 1) if args.get("fallback_model_dir") else 0)
    assert workers["maxReplicas"] >= engines                     # a pod (GPU) for every replica
    assert workers["minReplicas"] >= engines - args["max_replicas"] + args["min_replicas"]
    assert pod["terminationGracePeriodSeconds"] > args["graceful_shutdown_s"]
    images = {c["image"]} | {x["image"] for x in
                             doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]}
    assert len(images) == 1


def test_ray_takes_a_token_from_a_secret_and_the_dashboard_is_not_opened_by_us():
    doc, _ = _load()
    rc = doc["spec"]["rayClusterConfig"]
    auth = rc["authOptions"]                         # KubeRay >= 1.6 field names
    assert auth["mode"] == "token"
    assert auth["secretName"] and auth["secretName"] != "triton-llm-api-keys"
    assert "dashboard-host" not in rc["headGroupSpec"]["rayStartParams"]
    for group in [rc["headGroupSpec"], *rc["workerGroupSpecs"]]:
        # a token or an auth mode set by hand would override the operator's from the Secret
        for c in group["template"]["spec"]["containers"]:
            names = {e["name"] for e in c.get("env", [])}
            assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}, names


def test_network_policy_admits_only_the_cluster_and_the_operator_to_rays_ports():
    docs = _docs()
    pol = docs["NetworkPolicy"]
    assert pol["apiVersion"] == "networking.k8s.io/v1" and pol["spec"]["policyTypes"] == ["Ingress"]
    selected = pol["spec"]["podSelector"]["matchLabels"]
    for tmpl in _pod_specs(docs["RayService"]):      # every Ray pod is under the policy
        assert selected.items() <= tmpl["metadata"]["labels"].items()
    rules = pol["spec"]["ingress"]

    def admits(rule, port: int) -> bool:
        return "ports" not in rule or any(p["port"] == port for p in rule["ports"])

    for port in RAY_CONTROL_PORTS:
        for rule in filter(lambda r: admits(r, port), rules):
            assert rule.get("from"), f"port {port} open to every pod"
            for peer in rule["from"]:
                pods = peer["podSelector"]["matchLabels"]
                if "namespaceSelector" in peer:      # only the operator, in its own namespace
                    assert pods == {"app.kubernetes.io/name": "kuberay-operator"}
                    assert peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                    assert [p["port"] for p in rule["ports"]] == [8265]
                else:                                # or the Ray cluster's own pods
                    assert pods == selected
    open_rules = [r for r in rules if not r.get("from")]
    assert [p["port"] for r in open_rules for p in r["ports"]] == [8000]   # the OpenAI API only


def test_ray_pods_run_as_non_root_with_a_read_only_root():
    doc, _ = _load()
    for tmpl in _pod_specs(doc):
        pod = tmpl["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        mounts_by_volume = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            sec = c["securityContext"]
            assert sec["readOnlyRootFilesystem"] is True and sec["allowPrivilegeEscalation"] is False
            assert sec["capabilities"]["drop"] == ["ALL"]
            writable = {m["mountPath"]: mounts_by_volume[m["name"]] for m in c["volumeMounts"]}
            assert "emptyDir" in writable["/tmp"] and writable["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    auto = doc["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]
    assert auto["runAsNonRoot"] is True and auto["allowPrivilegeEscalation"] is False


def test_cli_replicas_flags_make_a_scale_config():
    from triton_llm.cli import build_parser
    from triton_llm.scale.run import config_from_args

    args = build_parser().parse_args(["serve", "--model", "m", "--replicas", "2", "--max-replicas", "3",
                                      "--engine-option", "block_size=32", "--fallback-model", "small",
                                      "--fallback-tenant", "*"])
    cfg = config_from_args(args)
    assert (cfg.replicas, cfg.autoscale, cfg.max_replicas, cfg.block_size) == (2, True, 3, 32)
    assert cfg.fallback_model_dir == "small" and cfg.fallback_tenants == ["*"] and cfg.prefix_routing
    plain = build_parser().parse_args(["serve", "--model", "m"])
    assert plain.replicas is None                                # plain serve never touches Ray


def test_pod_templates_are_valid_kubernetes_objects():
    """kubernetes-validate (offline Kubernetes schemas) on the head and worker pod templates, as
    PodTemplate objects: it has no schema for KubeRay's RayService CRD itself (our rules above)."""
    kv = pytest.importorskip("kubernetes_validate")
    doc, _ = _load()
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate(doc, "1.30", strict=True)                # a custom resource: checked by our rules
    kv.validate(_docs()["NetworkPolicy"], "1.30", strict=True)
    rc = doc["spec"]["rayClusterConfig"]
    groups = [("head", rc["headGroupSpec"])] + [(w["groupName"], w) for w in rc["workerGroupSpecs"]]
    for name, group in groups:
        obj = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"triton-llm-{name}"},
               "template": group["template"]}
        kv.validate(obj, "1.30", strict=True)                # raises ValidationError on a bad field
    broken = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "broken"},
              "template": {"spec": {"containers": [{"name": "c", "image": "i", "resource": {}}]}}}
    with pytest.raises(kv.ValidationError):                  # the validator does catch a typo
        kv.validate(broken, "1.30", strict=True)


def _pinned(name: str) -> str:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith(name + "=="):
            return line.split("==")[1].split()[0]
    raise AssertionError(f"{name} is not pinned")
