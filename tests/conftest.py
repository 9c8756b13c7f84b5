"""Root of the test tree: test helpers are imported as modules (`from tests.nslib import sh`),
and the namespace fixtures every kernel test uses are defined once, here."""
from __future__ import annotations

import os
import sys

import pytest

# The repository root on sys.path, so `tests.<module>` imports work however pytest is started.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.nslib import Namespaces, skip_unless  # noqa: E402


@pytest.fixture
def namespaces(request):
    """A Namespaces set for this test (skipped with the reason where namespaces are unavailable)."""
    skip_unless()
    with Namespaces(request.node.name.split("[")[0][-20:].replace("_", "-")) as nss:
        yield nss


@pytest.fixture
def netns(namespaces) -> str:
    """One fresh network namespace (lo up) for this test, deleted afterwards."""
    return namespaces.add("ns")
