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
4. prints the image's size and what clusterdns adds to its base (`podman image
   inspect` sizes) and fails above the floor (ADDED_FLOOR_MB); checks the venv
   holds no installer, no tests and no docs, every module's bytecode
   (unchecked-hash) and stripped extension modules;
5. runs the image's own entrypoint and command (`clusterdns agent`, the demo
   cluster) from its root filesystem (`podman image mount`) with chroot in a
   network namespace, and resolves a name with dig over UDP and TCP; then the
   same agent against a fake API server (tests/fakeapi.py) in that namespace,
   so the kubernetes client the image trimmed still lists and watches;
6. checks that the image's own iptables-nft-restore and nft accept the rules
   its clusterdns renders (--test / -c, in a fresh namespace).

Skipped with the reason where root, podman, debootstrap or dig are missing;
CI installs them (scripts/setup). Phase times are printed (-s): a fresh
machine spends ~1.5 min in debootstrap and ~35-50 s in the build; a rerun
~1 min (the build is redone: --layers=false keeps no intermediate images).
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
import struct
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
# What the image may add to its base, in MB (10^6 bytes, as podman counts): the floor.
ADDED_FLOOR_MB = 120
VENV = "opt/clusterdns"

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
        # --layers=false: the builder stage leaves no intermediate images behind
        run(["podman", "build", "--isolation", "chroot", "--layers=false", "--build-arg", f"BASE={base}", *lend,
             "-t", tag, "-f", str(REPO / "Dockerfile"), str(REPO)], timeout=1800)
        t = phase("podman build", t)
        image = json.loads(run(["podman", "image", "inspect", tag], timeout=60).stdout)[0]
        info = image["Config"]
        assert info["Entrypoint"] == ["/opt/clusterdns/bin/clusterdns"]
        assert info["Cmd"] == ["agent"]
        assert "PYTHONDONTWRITEBYTECODE=1" in info["Env"]
        base_size = json.loads(run(["podman", "image", "inspect", base], timeout=60).stdout)[0]["Size"]
        added = (image["Size"] - base_size) / 1e6
        print(f"image test: image {image['Size'] / 1e6:.1f} MB, base {base_size / 1e6:.1f} MB: "
              f"clusterdns adds {added:.1f} MB (floor {ADDED_FLOOR_MB} MB)", file=sys.stderr)
        assert added <= ADDED_FLOOR_MB, f"the image adds {added:.1f} MB to its base, over {ADDED_FLOOR_MB} MB"
        mnt = run(["podman", "image", "mount", tag], timeout=120).stdout.strip()
        try:
            root = Path(mnt)
            # What the agent drives is in the image, next to it.
            for tool in ("usr/sbin/iptables-nft-restore", "usr/sbin/nft", "usr/sbin/ipset",
                         "usr/sbin/conntrack", "bin/ip"):
                assert (root / tool).exists() or (root / "usr" / tool).exists(), tool
            venv_is_lean(root)
            run_agent_from(root, info["Entrypoint"] + info["Cmd"], tmp_path)
            run_agent_from(root, info["Entrypoint"] + info["Cmd"], tmp_path, kube=True)
            rules_load_with_the_image_tools(root)
        finally:
            subprocess.run(["podman", "image", "umount", tag], capture_output=True, timeout=120, check=False)
        phase("agent from the image's root, dig, rules check", t)
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, timeout=300, check=False)


def _elf_sections(path: Path) -> set[str]:
    """Section names of a little-endian ELF64 file (enough to tell a stripped one)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, path
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    return {names[h[0]:names.index(b"\0", h[0])].decode() for h in headers}


def venv_is_lean(root: Path) -> None:
    """No installer, tests or docs in the venv; every module compiled (unchecked-hash, so
    never rewritten); extension modules without symbol tables."""
    venv = root / VENV
    sites = list(venv.glob("lib/python3*/site-packages"))
    assert len(sites) == 1, sites
    site = sites[0]
    for name in ("pip", "setuptools", "wheel", "pkg_resources", "_distutils_hack"):
        assert not (site / name).exists(), name
    assert not list(venv.glob("bin/pip*"))
    assert not (root / "src").exists()
    dirs = {p.name for p in venv.rglob("*") if p.is_dir()}
    assert not dirs & {"tests", "test", "docs"}, dirs & {"tests", "test", "docs"}
    missing, checked = [], []
    for py in site.rglob("*.py"):
        pyc = py.parent / "__pycache__" / f"{py.stem}.{sys.implementation.cache_tag}.pyc"
        if not pyc.exists():
            missing.append(str(py.relative_to(site)))
            continue
        flags, = struct.unpack_from("<I", pyc.read_bytes(), 4)
        if flags != 0b01:   # hash-based, source not checked (PEP 552)
            checked.append(str(pyc.relative_to(site)))
    assert not missing, f"{len(missing)} modules without bytecode: {missing[:5]}"
    assert not checked, f"{len(checked)} timestamp or checked-hash pycs: {checked[:5]}"
    so = list(site.rglob("*.so"))
    assert so and not [p for p in so if ".symtab" in _elf_sections(p)]


def _fake_api_in(node: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """tests/fakeapi.py serving one Service inside namespace `node`; its kubeconfig in a
    directory of its own (bound onto the image's /tmp)."""
    kube = tmp_path / "kube"
    kube.mkdir(exist_ok=True)
    script = (
        "import sys\n"
        "from tests.fakeapi import FakeAPIServer, endpoint_slice, namespace, service\n"
        "api = FakeAPIServer().start()\n"
        "api.add(namespace('imgns'))\n"
        "api.add(service('imgns', 'web', '10.96.77.7'))\n"
        "api.add(endpoint_slice('imgns', 'web', ['10.244.7.7']))\n"
        f"api.write_kubeconfig({str(kube / 'kubeconfig')!r})\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n")
    proc = subprocess.Popen(["ip", "netns", "exec", node, sys.executable, "-c", script], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, kube


def run_agent_from(root: Path, argv: list[str], tmp_path: Path, kube: bool = False) -> None:
    """The image's command, chrooted into its root in a fresh network namespace: with the demo
    cluster (DNS on 5353, rules not applied), or (kube) reading a fake API server through the
    image's kubernetes client, as deployed: DNS on 53, rules applied with the image's iptables."""
    log = tmp_path / ("agent-kube.log" if kube else "agent.log")
    with Namespaces("image") as nss:
        node = nss.add("node")
        api = None
        extra: list[str] = []
        # /proc, /dev and a writable /run (xtables.lock) inside the root, in ip netns exec's
        # own mount namespace (gone with it).
        mounts = (f'mount -t proc proc "{root}/proc" && mount --rbind /dev "{root}/dev" '
                  f'&& mount -t tmpfs tmpfs "{root}/run"')
        if kube:
            api, kube_dir = _fake_api_in(node, tmp_path)
            mounts += f' && mount --bind "{kube_dir}" "{root}/tmp"'
            extra = ["--kubeconfig", "/tmp/kubeconfig"]
        script = f'{mounts} && exec chroot "{root}" "$@"'
        with open(log, "w") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", node, "sh", "-c", script, "agent",
                                     *argv, *extra, "--no-upstream", "--lameduck", "0"],
                                    stdout=out, stderr=subprocess.STDOUT)
        try:
            name, want = (("web.imgns.svc.cluster.local", "10.96.77.7") if kube else
                          ("testapp-svc.testapp.svc.cluster.local", "172.20.36.232"))
            port = "53" if kube else "5353"
            deadline = time.monotonic() + 60
            answer = ""
            while time.monotonic() < deadline and proc.poll() is None:
                answer = sh("dig", "+short", "+time=1", "+tries=1", "@127.0.0.1", "-p", port, name, "A",
                            ns=node, check=False).strip()
                if answer and not answer.startswith(";"):
                    break
                time.sleep(0.3)
            assert answer == want, f"dig: {answer!r}\n{log.read_text()[-3000:]}"
            if not kube:
                tcp = sh("dig", "+short", "+tcp", "+time=2", "+tries=1", "@127.0.0.1", "-p", "5353",
                         "kube-dns.kube-system.svc.cluster.local", "A", ns=node).strip()
                assert tcp == "172.20.0.10", tcp
            missing = "missing.imgns.svc.cluster.local" if kube else "missing.testapp.svc.cluster.local"
            nx = sh("dig", "+time=2", "+tries=1", "@127.0.0.1", "-p", port, missing, ns=node)
            assert "status: NXDOMAIN" in nx, nx
            if kube:
                # the Service's rules, written by the image's iptables-nft-restore
                ruleset = ""
                while time.monotonic() < deadline and "10.244.7.7" not in ruleset:
                    ruleset = sh("nft", "list", "ruleset", ns=node)
                    time.sleep(0.3)
                assert "10.96.77.7" in ruleset and "10.244.7.7" in ruleset, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if api is not None:
                assert api.stdin is not None
                api.stdin.close()
                api.wait(15)
        assert proc.returncode == 0, log.read_text()[-3000:]
        if kube:
            assert "watching " in log.read_text(), log.read_text()[-3000:]
        else:
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
