"""Trim the image's virtual environment to what running clusterdns needs (the Dockerfile's builder stage).

    python3 scripts/image_slim.py /opt/clusterdns

Removes, printing what each rule freed:
* the installers (pip, setuptools, wheel and their hooks): nothing is installed at run time;
* the kubernetes client's generated API classes and models (client/ and aio/client/ api/ and
  models/, ~75 MB of source): clusterdns speaks raw list/watch through ApiClient.call_api
  (sources/reflector.py) and never imports them; their packages' __init__ (lazy name tables,
  imported by the client) stay, so `from kubernetes.aio import client, config` works as before;
* test modules and directories the dependencies ship, C/Cython sources and headers, type stubs;
* every __pycache__, then compiles all bytecode once, unchecked-hash: valid whatever the files'
  timestamps become when the stage is copied, so Python never recompiles or writes it at run time.

Stripping the extension modules' symbol tables is the Dockerfile's (it needs binutils).
"""
from __future__ import annotations

import compileall
import glob
import os
import py_compile
import shutil
import sys

INSTALLERS = ("pip", "setuptools", "wheel", "pkg_resources", "_distutils_hack")
KUBE_GENERATED = ("kubernetes/client/api", "kubernetes/client/models",
                  "kubernetes/aio/client/api", "kubernetes/aio/client/models")
SOURCES = (".pyx", ".pxd", ".pxi", ".c", ".h", ".cpp", ".hpp", ".pyi")
TEST_DIRS = ("tests", "test")


def size(path: str) -> int:
    if os.path.islink(path) or not os.path.isdir(path):
        return os.lstat(path).st_size
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)


def remove(paths: list[str]) -> int:
    freed = 0
    for p in paths:
        if not os.path.lexists(p):
            continue
        freed += size(p)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
    return freed


def site_packages(venv: str) -> str:
    found = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))
    if len(found) != 1:
        sys.exit(f"{venv}: expected one lib/python3*/site-packages, found {found}")
    return found[0]


def rules(venv: str, site: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    inst = []
    for name in INSTALLERS:
        inst += glob.glob(os.path.join(site, name))
        inst += glob.glob(os.path.join(site, f"{name}-*.dist-info"))
    inst += glob.glob(os.path.join(site, "distutils-precedence.pth"))
    inst += glob.glob(os.path.join(venv, "bin", "pip*")) + glob.glob(os.path.join(venv, "bin", "wheel"))
    out["installers"] = inst
    gen = []
    for d in KUBE_GENERATED:
        gen += [p for p in glob.glob(os.path.join(site, d, "*")) if os.path.basename(p) != "__init__.py"]
    out["kubernetes generated api/models"] = gen
    tests, sources, caches = [], [], []
    for d, dirs, files in os.walk(site):
        for sub in dirs:
            if sub in TEST_DIRS:
                tests.append(os.path.join(d, sub))
            elif sub == "__pycache__":
                caches.append(os.path.join(d, sub))
        dirs[:] = [s for s in dirs if s not in TEST_DIRS and s != "__pycache__"]
        for f in files:
            if f.endswith("_test.py"):   # the kubernetes client's unit tests beside its modules
                tests.append(os.path.join(d, f))
            elif f.endswith(SOURCES):
                sources.append(os.path.join(d, f))
    out["tests"] = tests
    out["C/Cython sources, headers, stubs"] = sources
    out["__pycache__"] = caches
    return out


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__.splitlines()[2])
    venv = os.path.abspath(sys.argv[1])
    site = site_packages(venv)
    for name, paths in rules(venv, site).items():
        print(f"image_slim: {name}: {len(paths)} paths, {remove(paths) / 2**20:.1f} MB")
    ok = compileall.compile_dir(site, quiet=1, workers=0,
                                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    if not ok:
        print("image_slim: compileall reported errors", file=sys.stderr)
        return 1
    print(f"image_slim: site-packages now {size(site) / 2**20:.1f} MB (bytecode included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
