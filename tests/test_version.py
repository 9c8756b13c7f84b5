"""`clusterdns --version` and the build_info series: the package version and the git revision,
from a checkout's git at run time or from clusterdns/_build.py written at build time."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import clusterdns
from clusterdns.config import load
from clusterdns.health import HealthServer
from clusterdns.version import git_revision
from tests.common import http_get
from tests.netutil import free_port

REPO = Path(__file__).resolve().parents[1]
GIT = shutil.which("git")
needs_git = pytest.mark.skipif(GIT is None, reason="git is not installed")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.email=t@example.org", "-c", "user.name=t", *args],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def _version(*, cwd: Path, pythonpath: str | None = None) -> tuple[int, list[str], str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    res = subprocess.run([sys.executable, "-m", "clusterdns", "--version"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    return res.returncode, res.stdout.splitlines(), res.stderr


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A git checkout of the package's sources with one commit (clean tree)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "clusterdns", src / "clusterdns",
                    ignore=shutil.ignore_patterns("__pycache__", "_build.py"))
    _git(src, "init", "-q")
    _git(src, "add", "-A")
    _git(src, "commit", "-qm", "the sources")
    return src


@needs_git
def test_version_from_this_checkout_is_its_head():
    if not (REPO / ".git").exists():
        pytest.skip("not running from a git checkout")
    head = _git(REPO, "rev-parse", "HEAD")
    dirty = bool(_git(REPO, "status", "--porcelain", "--untracked-files=no"))
    code, lines, err = _version(cwd=REPO)
    assert code == 0, err
    assert lines[0] == f"clusterdns {clusterdns.__version__}"
    assert lines[1] == f"revision: {head}" + (" (dirty tree)" if dirty else "")
    assert lines[-1].startswith("linux/") and platform.python_version() in lines[-1]
    assert err == ""


@needs_git
def test_a_checkout_answers_from_git_at_run_time_and_follows_its_head(checkout):
    code, lines, _ = _version(cwd=checkout, pythonpath=str(checkout))
    head = _git(checkout, "rev-parse", "HEAD")
    assert code == 0 and lines[1] == f"revision: {head}"
    (checkout / "README.md").write_text("changed\n")
    assert _version(cwd=checkout, pythonpath=str(checkout))[1][1] == f"revision: {head} (dirty tree)"
    _git(checkout, "commit", "-qam", "second")
    second = _git(checkout, "rev-parse", "HEAD")
    assert second != head
    assert _version(cwd=checkout, pythonpath=str(checkout))[1][1] == f"revision: {second}"


def test_without_git_or_a_build_record_the_revision_is_unknown(tmp_path):
    shutil.copytree(REPO / "clusterdns", tmp_path / "clusterdns",
                    ignore=shutil.ignore_patterns("__pycache__", "_build.py"))
    code, lines, err = _version(cwd=tmp_path, pythonpath=str(tmp_path))
    assert code == 0, err
    assert lines[:2] == [f"clusterdns {clusterdns.__version__}", "revision: unknown"]
    assert not any(l.startswith("built:") for l in lines)


def _build_py(src: Path, out: Path, **env: str) -> dict[str, str]:
    """setup.py's build_py into `out`; the generated record's values."""
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)], cwd=src,
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    values: dict[str, str] = {}
    exec((out / "clusterdns" / "_build.py").read_text(), {}, values)
    return values


@needs_git
def test_the_build_records_the_checkouts_revision_in_the_built_package_only(checkout, tmp_path):
    head = _git(checkout, "rev-parse", "HEAD")
    built = _build_py(checkout, tmp_path / "b1")
    assert (built["REVISION"], built["TREE_STATE"]) == (head, "clean")
    assert built["BUILD_DATE"].endswith("Z") and built["BUILD_DATE"][:2] == "20"
    # The source tree stays as committed: the record is a build output.
    assert not (checkout / "clusterdns" / "_build.py").exists()
    (checkout / "clusterdns" / "lazy.py").write_text("# edited\n")
    built = _build_py(checkout, tmp_path / "b2")
    assert (built["REVISION"], built["TREE_STATE"]) == (head, "dirty")
    # Where there is no .git (the image build), the revision is handed in.
    built = _build_py(checkout, tmp_path / "b3", CLUSTERDNS_REVISION="f" * 40, CLUSTERDNS_TREE_STATE="clean",
                      SOURCE_DATE_EPOCH="0")
    assert built == {"REVISION": "f" * 40, "TREE_STATE": "clean", "BUILD_DATE": "1970-01-01T00:00:00Z"}


@pytest.mark.slow
@needs_git
def test_pip_install_of_a_checkout_records_its_revision(checkout, tmp_path):
    """`pip install .` (a wheel built in an isolated environment, so pip fetches setuptools from
    its index): the installed package, outside any checkout, reports the revision it was built from."""
    target = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                          "--target", str(target), str(checkout)],
                         capture_output=True, text=True, timeout=600, check=False)
    if res.returncode != 0 and any(s in res.stderr for s in ("No matching distribution", "Could not find a version",
                                                              "NewConnectionError", "Network is unreachable")):
        pytest.skip(f"pip cannot fetch the build backend here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr[-3000:]
    head = _git(checkout, "rev-parse", "HEAD")
    code, lines, err = _version(cwd=tmp_path, pythonpath=str(target))
    assert code == 0, err
    assert lines[1] == f"revision: {head}"
    assert lines[2].startswith("built: 20")
    # What was run is the installed copy, not the checkout or the tests' editable install.
    where = subprocess.run([sys.executable, "-c", "import clusterdns; print(clusterdns.__file__)"], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True,
                           timeout=60, check=True).stdout.strip()
    assert where.startswith(str(target))


def _samples(text: str, name: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


async def test_build_info_series_on_their_listeners():
    import clusterdns.dns.metrics  # noqa: F401  (registers coredns_*)
    import clusterdns.proxy.proxier  # noqa: F401  (registers kubeproxy_* and kubernetes_build_info)
    ports = {k: free_port() for k in ("dns", "proxy")}
    cfg = load(["agent", "--manifest", "x", "--health-listen", "none", "--metrics-listen", f"127.0.0.1:{ports['dns']}",
                "--proxy-metrics-listen", f"127.0.0.1:{ports['proxy']}"], env={})
    srv = HealthServer(cfg, roles=("dns", "proxy"))
    await srv.start()
    try:
        dns_text = (await http_get(ports["dns"], "/metrics"))[1]
        proxy_text = (await http_get(ports["proxy"], "/metrics"))[1]
    finally:
        await srv.stop()
    rev, state = git_revision(str(REPO)) if (REPO / ".git").exists() and GIT else ("", "")
    version = clusterdns.__version__
    assert _samples(dns_text, "coredns_build_info") == [
        {"version": version, "revision": rev[:7], "goversion": "python" + platform.python_version()}]
    major, minor = version.split(".")[:2]
    [kube] = _samples(proxy_text, "kubernetes_build_info")
    assert kube == {"major": major, "minor": minor, "git_version": "v" + version, "git_commit": rev,
                    "git_tree_state": state, "build_date": "", "go_version": "python" + platform.python_version(),
                    "compiler": platform.python_implementation().lower(), "platform": kube["platform"]}
    assert re.fullmatch(r"linux/(amd64|arm64|arm|386|ppc64le|s390x|riscv64)", kube["platform"]), kube["platform"]
    # Each on its own listener only.
    assert _samples(proxy_text, "coredns_build_info") == [] and _samples(dns_text, "kubernetes_build_info") == []


def test_version_into_a_closed_pipe_is_quiet():
    """`clusterdns --version | head -0`: the reader is gone before the write; no traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([sys.executable, "-m", "clusterdns", "--version"], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO, check=False)
    finally:
        os.close(write)
    assert res.returncode == 0 and res.stderr == "", res.stderr
