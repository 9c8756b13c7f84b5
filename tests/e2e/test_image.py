"""The Dockerfile, built and run on this machine.

No registry here serves python:3.11-slim-bookworm, and containers cannot run
here (setrlimit is refused), so the test:

1. builds a Debian 12 root with debootstrap (minbase + python3, python3-venv),
   cached as a tarball under /var/cache/clusterdns-test (CLUSTERDNS_TEST_CACHE)
   so that reruns skip it;
2. `podman import`s it as a local base image;
3. `podman build --isolation chroot --build-arg BASE=<that base>`, lending
   pip inside the build this machine's global pip configuration, the files it
   names and the CA bundle (read-only), without which PyPI is unreachable here;
4. runs the image's own entrypoint and command (`clusterdns agent`, the demo
   cluster) from its root filesystem (`podman image mount`) with chroot in a
   network namespace, and resolves a name with dig over UDP and TCP;
5. checks that the image's own iptables-nft-restore and nft accept the rules
   its clusterdns renders (--test / -c, in a fresh namespace).

Skipped with the reason where root, podman, debootstrap or dig are missing;
CI installs them (scripts/setup). Phase times are printed (-s): a fresh
machine spends ~1.5 min in debootstrap and ~35-50 s in the build; a rerun
~1 min (the build is redone: removing the test's tag removes its layers).
"""
from __future__ import annotations

import configparser
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.nslib import Namespaces, missing, sh

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("CLUSTERDNS_TEST_CACHE", "/var/cache/clusterdns-test"))
SUITE = "bookworm"
MIRROR = os.environ.get("CLUSTERDNS_TEST_MIRROR", "http://deb.debian.org/debian")
VARIANT = "minbase"
INCLUDE = ("python3", "python3-venv")
BASE_KEY = hashlib.sha256(f"{SUITE} {VARIANT} {' '.join(INCLUDE)} {MIRROR}".encode()).hexdigest()[:12]
BASE_IMAGE = f"localhost/clusterdns-test-base:{SUITE}-{BASE_KEY}"

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _why_not() -> str:
    return missing("podman", "debootstrap", "dig", "chroot", "tar", "bash")


@pytest.fixture(scope="module")
def skip_reason() -> None:
    reason = _why_not()
    if reason:
        pytest.skip(reason)


def phase(name: str, start: float) -> float:
    now = time.monotonic()
    print(f"image test: {name}: {now - start:.1f}s", file=sys.stderr)
    return now


def run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:6])}...: exit {res.returncode}:\n"
                             f"{(res.stdout + res.stderr)[-4000:]}")
    return res


@contextlib.contextmanager
def cache_lock():
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)      # two test runs build the base once
        yield


def base_tarball() -> Path:
    """The debootstrapped root as a tarball, built once per (suite, variant, packages)."""
    tar = CACHE / f"{SUITE}-{VARIANT}-{BASE_KEY}.tar"
    if tar.exists():
        return tar
    root = CACHE / f"root-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    try:
        run(["debootstrap", f"--variant={VARIANT}", f"--include={','.join(INCLUDE)}", SUITE, str(root), MIRROR],
            timeout=1800)
        # apt's downloads are not part of a base image.
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        partial = tar.with_suffix(".partial")
        run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], timeout=600)
        partial.replace(tar)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return tar


def base_image() -> str:
    with cache_lock():
        if subprocess.run(["podman", "image", "exists", BASE_IMAGE], check=False).returncode != 0:
            tar = base_tarball()
            run(["podman", "import", "--change", "CMD=/bin/bash", str(tar), BASE_IMAGE], timeout=600)
    return BASE_IMAGE


def _paths_in(value: str) -> list[str]:
    out = []
    for word in value.split():
        word = word.removeprefix("file://")
        if word.startswith("/") and os.path.exists(word):
            out.append(word)
    return out


def pip_lendings() -> list[str]:
    """Paths pip inside the build needs to reach PyPI as pip here does: the global
    configuration files (`pip config debug`), the files they name (CA bundle,
    constraints), and the CA bundles named by the environment."""
    debug = subprocess.run([sys.executable, "-m", "pip", "config", "debug"],
                           capture_output=True, text=True, timeout=60, check=False).stdout
    files: list[str] = []
    section = ""
    for line in debug.splitlines():
        if not line.startswith(" "):
            section = line.rstrip(":").strip()
            continue
        m = re.match(r"\s+(/\S.*), exists: True$", line)
        if m and section == "global":
            files.append(m.group(1))
    paths = set(files)
    for f in files:
        parser = configparser.RawConfigParser()
        parser.read(f)
        for sec in parser.sections():
            for _key, value in parser.items(sec):
                paths.update(_paths_in(value))
    for var in ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_CONSTRAINT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        paths.update(_paths_in(os.environ.get(var, "")))
    return sorted(paths)


def test_image_builds_from_a_local_debian_base_and_answers_dns(skip_reason, tmp_path):
    t0 = time.monotonic()
    base = base_image()
    t = phase("base image (debootstrap + import, or cached)", t0)

    tag = f"localhost/clusterdns-test:{os.getpid()}"
    lend = []
    for path in pip_lendings():
        lend += ["-v", f"{path}:{path}:ro"]
    try:
        run(["podman", "build", "--isolation", "chroot", "--build-arg", f"BASE={base}", *lend,
             "-t", tag, "-f", str(REPO / "Dockerfile"), str(REPO)], timeout=1800)
        t = phase("podman build", t)
        info = json.loads(run(["podman", "image", "inspect", tag], timeout=60).stdout)[0]["Config"]
        assert info["Entrypoint"] == ["/opt/clusterdns/bin/clusterdns"]
        assert info["Cmd"] == ["agent"]
        mnt = run(["podman", "image", "mount", tag], timeout=120).stdout.strip()
        try:
            root = Path(mnt)
            # What the agent drives is in the image, next to it.
            for tool in ("usr/sbin/iptables-nft-restore", "usr/sbin/nft", "usr/sbin/ipset",
                         "usr/sbin/conntrack", "bin/ip"):
                assert (root / tool).exists() or (root / "usr" / tool).exists(), tool
            run_agent_from(root, info["Entrypoint"] + info["Cmd"], tmp_path)
            rules_load_with_the_image_tools(root)
        finally:
            subprocess.run(["podman", "image", "umount", tag], capture_output=True, timeout=120, check=False)
        phase("agent from the image's root, dig, rules check", t)
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, timeout=300, check=False)


def run_agent_from(root: Path, argv: list[str], tmp_path: Path) -> None:
    """The image's command, chrooted into its root in a fresh network namespace."""
    log = tmp_path / "agent.log"
    with Namespaces("image") as nss:
        node = nss.add("node")
        # /proc and /dev inside the root, in ip netns exec's own mount namespace (gone with it).
        script = (f'mount -t proc proc "{root}/proc" && mount --rbind /dev "{root}/dev" '
                  f'&& exec chroot "{root}" "$@"')
        with open(log, "w") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", node, "sh", "-c", script, "agent",
                                     *argv, "--no-upstream", "--lameduck", "0"],
                                    stdout=out, stderr=subprocess.STDOUT)
        try:
            name = "testapp-svc.testapp.svc.cluster.local"
            deadline = time.monotonic() + 60
            answer = ""
            while time.monotonic() < deadline and proc.poll() is None:
                answer = sh("dig", "+short", "+time=1", "+tries=1", "@127.0.0.1", "-p", "5353", name, "A",
                            ns=node, check=False).strip()
                if answer and not answer.startswith(";"):
                    break
                time.sleep(0.3)
            assert answer == "172.20.36.232", f"dig: {answer!r}\n{log.read_text()[-3000:]}"
            tcp = sh("dig", "+short", "+tcp", "+time=2", "+tries=1", "@127.0.0.1", "-p", "5353",
                     "kube-dns.kube-system.svc.cluster.local", "A", ns=node).strip()
            assert tcp == "172.20.0.10", tcp
            nx = sh("dig", "+time=2", "+tries=1", "@127.0.0.1", "-p", "5353", "missing.testapp.svc.cluster.local",
                    ns=node)
            assert "status: NXDOMAIN" in nx, nx
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 0, log.read_text()[-3000:]
        assert "loaded /opt/clusterdns/lib/python3.11/site-packages/clusterdns/demo/cluster.yaml" in log.read_text()


def rules_load_with_the_image_tools(root: Path) -> None:
    """The image's own iptables-nft-restore and nft accept what its clusterdns writes
    (checked, not applied, in a fresh namespace): the tools and the renderer agree."""
    with Namespaces("imgrules") as nss:
        node = nss.add("node")
        for mode, check in (("iptables", "iptables-nft-restore --test"), ("nftables", "nft -c -f -")):
            script = (f'chroot "{root}" /opt/clusterdns/bin/clusterdns rules --mode {mode} '
                      f'| chroot "{root}" {check}')
            res = subprocess.run(["ip", "netns", "exec", node, "bash", "-c", f"set -o pipefail; {script}"],
                                 capture_output=True, text=True, timeout=120, check=False)
            assert res.returncode == 0, f"{mode}: {res.stderr[-2000:]}"
