"""Fixtures for the namespace tests: one cluster per module, one proxy per mode."""
import os

import pytest

from tests.integration.harness import Cluster, Proxy, manifest, missing_requirements
from tests.nslib import write_manifest

MODES = ["iptables", "nftables"]


def _skip_reason(mode: str) -> str:
    return missing_requirements((mode,))


@pytest.fixture(scope="module")
def cluster():
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    c = Cluster()
    try:
        c.up()
        yield c
    finally:
        c.down()


@pytest.fixture(scope="module", params=MODES)
def proxy(request, cluster, tmp_path_factory):
    reason = _skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp(f"proxy-{request.param}")
    path = os.path.join(d, "cluster.json")
    write_manifest(path, manifest())
    before = cluster.save_rules()
    p = Proxy(cluster, request.param, path, os.path.join(d, "proxy.log"))
    try:
        p.start()
        p.rules_before = before
        yield p
    finally:
        p.stop()
        p.cleanup()
