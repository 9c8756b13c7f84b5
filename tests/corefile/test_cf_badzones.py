"""Bad zone arguments to every plugin that takes zones: a CIDR that is not one, an empty label,
a label or name too long. Each is a setup error with FILE:LINE and the reason (exit 2 from the
commands), never a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clusterdns.config import Config
from clusterdns.corefile.build import load_corefile
from clusterdns.corefile.syntax import CorefileError

ROOT = Path(__file__).resolve().parents[2]

BAD = ["300.1.2.3/40", "1.2.3.4/99", "10.0.0.0/x", "::1/200", "/", "..", "a..b", "a.b..", "a" * 64 + ".example",
       ("a" * 60 + ".") * 5]

# each: the plugin's lines with {Z} where a zone goes (the block also holds what it needs)
USES = {
    "hosts zone": "hosts {H} {Z}",
    "hosts fallthrough": "hosts {H} {{\n        fallthrough {Z}\n    }}",
    "template zone": "template IN A {Z} {{\n        answer \"{{{{ .Name }}}} 60 IN A 192.0.2.1\"\n    }}",
    "template fallthrough": "template IN A example.org {{\n        answer \"{{{{ .Name }}}} 60 IN A 192.0.2.1\"\n"
                            "        fallthrough {Z}\n    }}",
    "kubernetes zone": "kubernetes cluster.local {Z}",
    "kubernetes fallthrough": "kubernetes cluster.local {{\n        fallthrough {Z}\n    }}",
    "forward from": "forward {Z} 127.0.0.1",
    "forward except": "forward . 127.0.0.1 {{\n        except {Z}\n    }}",
    "cache zone": "cache 30 {Z}",
    "cache disable": "cache 30 {{\n        disable success {Z}\n    }}",
    "autopath zone": "autopath {Z} @kubernetes\n    kubernetes cluster.local",
}


def _corefile(tmp_path: Path, use: str, zone: str) -> Path:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.1 a.example\n")
    body = USES[use].format(H=hosts, Z=zone)
    path = tmp_path / "Corefile"
    path.write_text(f"# bad zone: {use}\n.:53 {{\n    {body}\n}}\n")
    return path


@pytest.mark.parametrize("use", sorted(USES))
def test_every_bad_zone_argument_is_a_setup_error_with_file_and_line(tmp_path, use):
    cfg = Config.from_options("dns")
    for zone in BAD:
        path = _corefile(tmp_path, use, zone)
        lines = path.read_text().splitlines()
        with pytest.raises(CorefileError) as err:
            load_corefile(str(path), cfg)
        text = str(err.value)
        line = int(text.split(":", 2)[1]) if text.startswith(f"{path}:") else 0
        assert line >= 3 and zone in lines[line - 1], (zone, text)
        assert zone in text or "normalize" in text, (zone, text)


def test_the_good_ones_still_load(tmp_path):
    cfg = Config.from_options("dns")
    for use in USES:
        for zone in ("example.org", "10.0.0.0/8", "fd00::/64", "in-addr.arpa", "."):
            if use == "kubernetes zone" and zone == ".":
                continue      # refused for its own reason (the root cannot come from the state)
            load_corefile(str(_corefile(tmp_path, use, zone)), cfg)


@pytest.mark.parametrize("use,zone", [("hosts zone", "300.1.2.3/40"), ("template zone", "1.2.3.4/99"),
                                      ("cache zone", ".."), ("kubernetes fallthrough", "a..b")])
def test_the_commands_exit_2_with_file_and_line(tmp_path, use, zone):
    path = _corefile(tmp_path, use, zone)
    r = subprocess.run([sys.executable, "-m", "clusterdns", "config", "check", "--corefile", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if zone in text)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"clusterdns: {path}:{line}: plugin/"), last
