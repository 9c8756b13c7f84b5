"""The embedded demo cluster (clusterdns/demo/cluster.yaml) for tests: records, state, node config."""
from __future__ import annotations

from clusterdns.config import Config
from clusterdns.sources.manifest import DEMO_MANIFEST, load_files
from clusterdns.state import ClusterState, state_from_records

# The demo's own node, as `clusterdns rules` on the demo uses it, with both families' CIDRs.
DEMO_CFG = Config.from_options(command="rules", node_name="node-a", node_ips=("192.168.49.2",),
                  cluster_cidrs=("10.161.0.0/16", "fd00:161::/64"),
                  service_cidrs=("172.20.0.0/16", "fd00:20::/108"))


def demo_records() -> list:
    """The demo's records, read afresh (new objects on every call); every object is valid."""
    records, skipped = load_files([DEMO_MANIFEST])
    assert not skipped, skipped
    return records


def demo_state() -> ClusterState:
    """A state of the demo's records, built afresh on every call."""
    return state_from_records(demo_records())
