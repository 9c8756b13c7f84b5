"""Fixtures of the DNS tests: the demo cluster's records and state at a fixed serial.
Helpers are in tests/dns/dnskit.py, imported as a module."""
from __future__ import annotations

import pytest

from clusterdns.sources.manifest import DEMO_MANIFEST, load_files
from clusterdns.state import ClusterState
from tests.dns.dnskit import make_state


@pytest.fixture(scope="session")
def demo_records():
    records, skipped = load_files([DEMO_MANIFEST])
    assert not skipped
    return records


@pytest.fixture(scope="session")
def demo_state(demo_records) -> ClusterState:
    return make_state(demo_records)
