"""Every Kubernetes object under deploy/ is valid for the API schemas of each Kubernetes version we
support, strictly (an unknown or misspelt field fails), so a typo shows here and not on a cluster.

The schemas are kubernetes-validate's (the test extra), shipped inside its wheel: no network.
Documents that are not Kubernetes API objects, or whose kinds are CRDs without a schema there,
are listed by name below; anything else without a schema fails, so a new manifest cannot go
unchecked by accident.
"""
from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate as kv  # the test extra: a missing install fails, never skips
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# The client is pinned to Kubernetes 1.37 (kubernetes>=37,<38); managed clusters lag by several
# minors, so everything from 1.31 on is checked.
SUPPORTED = tuple(f"1.{minor}.0" for minor in range(31, 38))
# Not Kubernetes API objects.
NOT_OBJECTS = {"monitoring/kube-prometheus-stack-values.yaml"}   # Helm values
# (apiVersion, kind) with no schema in the Kubernetes OpenAPI: kind's config and the Prometheus
# Operator's CRDs.
NO_SCHEMA = {("kind.x-k8s.io/v1alpha4", "Cluster"), ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("monitoring.coreos.com/v1", "ServiceMonitor")}


def documents() -> list[tuple[str, int, dict]]:
    out = []
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        name = str(path.relative_to(DEPLOY))
        if name in NOT_OBJECTS:
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                out.append((name, i, doc))
    return out


def schema_checked() -> list[tuple[str, int, dict]]:
    return [(n, i, d) for n, i, d in documents() if (d.get("apiVersion"), d.get("kind")) not in NO_SCHEMA]


def test_the_schemas_ship_with_the_package_for_every_supported_version():
    shipped = set(kv.utils.all_versions())
    assert set(SUPPORTED) <= shipped, sorted(set(SUPPORTED) - shipped)


def test_every_manifest_is_listed_or_checked():
    docs = documents()
    kinds = {(d.get("apiVersion"), d.get("kind")) for _, _, d in docs}
    assert NO_SCHEMA <= kinds, f"listed but gone: {NO_SCHEMA - kinds}"   # keep the list true
    assert {"DaemonSet", "ConfigMap", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service"} <= \
        {d["kind"] for _, _, d in schema_checked()}
    for name in NOT_OBJECTS:
        assert (DEPLOY / name).exists(), name


@pytest.mark.parametrize("version", SUPPORTED)
def test_deploy_manifests_are_valid_for(version):
    failures = []
    for name, i, doc in schema_checked():
        try:
            kv.validate(doc, version, strict=True)
        except kv.utils.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            failures.append(f"{name}#{i} {doc.get('kind')}/{doc['metadata'].get('name')}: {path}: {exc.message}")
        except kv.utils.SchemaNotFoundError as exc:
            failures.append(f"{name}#{i}: {exc.message} (a Kubernetes object without a schema: list it in NO_SCHEMA "
                            "only if it is a CRD)")
    assert failures == [], "\n".join(failures)


def _daemonset() -> dict:
    [ds] = [d for _, _, d in schema_checked() if d["kind"] == "DaemonSet"]
    return copy.deepcopy(ds)


@pytest.mark.parametrize("mutate", [
    lambda ds: ds["spec"]["template"]["spec"].__setitem__("hostNetwrk", True),            # misspelt field
    lambda ds: ds["spec"]["template"]["spec"]["containers"][0].__setitem__("image", 7),   # wrong type
    lambda ds: ds["spec"].pop("selector"),                                                # required field
], ids=["unknown-field", "wrong-type", "missing-required"])
def test_the_validation_is_strict(mutate):
    """The check can fail: each of these broken copies of the DaemonSet is refused."""
    ds = _daemonset()
    kv.validate(ds, SUPPORTED[-1], strict=True)
    mutate(ds)
    with pytest.raises(kv.utils.ValidationError):
        kv.validate(ds, SUPPORTED[-1], strict=True)


@pytest.mark.root
def test_it_validates_without_a_network():
    """Run in a network namespace of its own (no interface but a down loopback): the schemas are local."""
    import os
    import shutil
    import subprocess
    import sys
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare")
    code = ("import sys, yaml, kubernetes_validate as kv\n"
            "doc = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d['kind'] == 'DaemonSet'][0]\n"
            "print(kv.validate(doc, sys.argv[2], strict=True))\n")
    res = subprocess.run(["unshare", "--net", sys.executable, "-c", code, str(DEPLOY / "daemonset.yaml"),
                          SUPPORTED[0]], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == SUPPORTED[0].rsplit(".", 1)[0]
