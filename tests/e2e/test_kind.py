"""Runs tests/e2e/kind/run.sh where kind and Docker exist (not on the dev machine)."""
import os
import shutil
import subprocess

import pytest

RUN = os.path.join(os.path.dirname(__file__), "kind", "run.sh")


def _docker_usable() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("kind") is None or shutil.which("kubectl") is None or not _docker_usable(),
                    reason="kind/docker not available")
def test_kind_cluster():
    proc = subprocess.run(["bash", RUN], timeout=1800)
    assert proc.returncode == 0


def test_run_script_is_valid_bash():
    subprocess.run(["bash", "-n", RUN], check=True)
