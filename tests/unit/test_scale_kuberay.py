"""docker/kuberay/rayservice.yaml checked offline: a RayService whose Serve config builds with our
app builder's fields, one engine per GPU, drains before pods go, and the CLI's --replicas flags."""
from __future__ import annotations

import dataclasses
import importlib
import pathlib

import pytest
import yaml

from backend.scale.app import ScaleConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "docker" / "kuberay" / "rayservice.yaml"


def _load():
    doc = yaml.safe_load(MANIFEST.read_text())
    return doc, yaml.safe_load(doc["spec"]["serveConfigV2"])


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


def test_cli_replicas_flags_make_a_scale_config():
    from backend.cli import build_parser
    from backend.scale.run import config_from_args

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
