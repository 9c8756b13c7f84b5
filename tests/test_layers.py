"""The layers meet only where they should: the DNS half (clusterdns.dns) and the proxy half
(clusterdns.proxy) never import each other, and nothing but `python -m clusterdns` imports the CLI.

Two checks. The static one parses every module's imports, those inside functions included (a lazy
import is still a dependency: `proxy --cleanup` reached the DNS half through one), and follows
them transitively, parent packages included (importing a.b.c runs a/__init__ and a/b/__init__).
The dynamic one imports each half's modules in a fresh interpreter and reads sys.modules.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "clusterdns"

# (importer, forbidden): no module of the first may reach a module of the second.
RULES = (
    ("clusterdns.proxy", "clusterdns.dns"),
    ("clusterdns.dns", "clusterdns.proxy"),
    ("clusterdns.sources", "clusterdns.cli"),
    ("clusterdns.sources", "clusterdns.commands"),
)
CLI_IMPORTERS = {"clusterdns.__main__"}   # the one module that may import clusterdns.cli


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def modules_under(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def direct_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that importing `name` runs directly (with their parent packages)."""
    top = name.split(".")[0]
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        # a.b.c where only a.b is a module (c a name in it): a.b
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            found.update(p for p in _parents(target) if p in modules)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if within(alias.name, top):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = name.split(".") if is_pkg else name.split(".")[:-1]
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not within(base, top):
                continue
            add(base)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:      # from . import iptables: a submodule
                    add(f"{base}.{alias.name}")
    found.discard(name)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> what importing it runs first: its parent package and its imports."""
    modules = modules_under(package_dir)
    graph = {name: direct_imports(name, path, modules) for name, path in modules.items()}
    for name, edges in graph.items():
        if "." in name:
            edges.add(name.rpartition(".")[0])
    return graph


def chain(graph: dict[str, set[str]], start: str, forbidden: str) -> list[str] | None:
    """The shortest import chain from `start` to a module of `forbidden`, or None."""
    seen = {start: ""}
    queue = deque(seen)
    while queue:
        mod = queue.popleft()
        if within(mod, forbidden):
            path = [mod]
            while seen[path[-1]]:
                path.append(seen[path[-1]])
            return path[::-1]
        for nxt in sorted(graph.get(mod, ())):
            if nxt not in seen:
                seen[nxt] = mod
                queue.append(nxt)
    return None


def violations(graph: dict[str, set[str]], rules=RULES, cli_importers=CLI_IMPORTERS,
               top: str = "clusterdns") -> list[str]:
    out = []
    for importer, forbidden in rules:
        for mod in sorted(graph):
            if within(mod, importer):
                found = chain(graph, mod, forbidden)
                if found:
                    out.append(f"{importer} imports {forbidden}: " + " -> ".join(found))
    for mod in sorted(graph):
        if mod not in cli_importers and f"{top}.cli" in graph[mod]:
            out.append(f"{mod} imports the CLI ({top}.cli)")
    return out


def test_the_halves_meet_only_in_the_agent():
    graph = import_graph(PACKAGE)
    assert "clusterdns.proxy.proxier" in graph and "clusterdns.dns.server" in graph   # the walk saw them
    assert violations(graph) == []


def test_the_agent_is_where_they_meet():
    """The check follows real edges: the agent does reach both halves."""
    graph = import_graph(PACKAGE)
    assert chain(graph, "clusterdns.agent", "clusterdns.dns")
    assert chain(graph, "clusterdns.agent", "clusterdns.proxy")
    assert chain(graph, "clusterdns.__main__", "clusterdns.cli") == ["clusterdns.__main__", "clusterdns.cli"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "clusterdns"


def test_the_check_sees_lazy_relative_and_transitive_crossings(tmp_path):
    pkg = _write(tmp_path, {
        "clusterdns/__init__.py": "",
        "clusterdns/__main__.py": "from .cli import entry\n",
        "clusterdns/cli.py": "",
        "clusterdns/shared.py": "def f():\n    from .dns import metrics\n",
        "clusterdns/dns/__init__.py": "",
        "clusterdns/dns/metrics.py": "",
        "clusterdns/dns/zone.py": "import clusterdns.proxy.names as n\n",
        "clusterdns/proxy/__init__.py": "",
        "clusterdns/proxy/names.py": "",
        "clusterdns/proxy/proxier.py": "def cleanup():\n    from .. import shared\n",
        "clusterdns/sources/__init__.py": "",
        "clusterdns/sources/manifest.py": "from ..cli import main\n",
    })
    found = violations(import_graph(pkg))
    assert found == [
        "clusterdns.proxy imports clusterdns.dns: clusterdns.proxy.proxier -> clusterdns.shared -> clusterdns.dns",
        "clusterdns.dns imports clusterdns.proxy: clusterdns.dns.zone -> clusterdns.proxy",
        "clusterdns.sources imports clusterdns.cli: clusterdns.sources.manifest -> clusterdns.cli",
        "clusterdns.sources.manifest imports the CLI (clusterdns.cli)",
    ], found
    # A package's __init__ counts: importing clusterdns.proxy.x runs it.
    (pkg / "proxy" / "__init__.py").write_text("from ..dns import metrics\n")
    assert any(v.startswith("clusterdns.proxy imports clusterdns.dns: clusterdns.proxy.names -> clusterdns.proxy -> "
                            "clusterdns.dns") for v in violations(import_graph(pkg)))


_LOADED = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "clusterdns" or m.startswith("clusterdns."))))
"""


@pytest.mark.parametrize(("half", "other"), [("clusterdns.proxy", "clusterdns.dns"),
                                             ("clusterdns.dns", "clusterdns.proxy")])
def test_importing_a_half_loads_nothing_of_the_other(half, other):
    names = [m for m in modules_under(PACKAGE) if within(m, half)]
    assert len(names) > 5
    res = subprocess.run([sys.executable, "-c", _LOADED, *names], capture_output=True, text=True, timeout=120,
                         check=False, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    loaded = json.loads(res.stdout)
    assert set(names) <= set(loaded)
    assert [m for m in loaded if within(m, other)] == []
