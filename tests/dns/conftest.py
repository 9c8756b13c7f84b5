"""Fixtures of the DNS tests: the demo cluster's records and state at a fixed serial.
Helpers are in tests/dns/dnskit.py, imported as a module."""
from __future__ import annotations

import pytest

from clusterdns.state import ClusterState
from tests import demo
from tests.dns.dnskit import make_state


@pytest.fixture(scope="session")
def demo_records():
    return demo.demo_records()


@pytest.fixture(scope="session")
def demo_state(demo_records) -> ClusterState:
    return make_state(demo_records)
