"""Start time: `clusterdns rules` as a whole process, and the agent's start path, at size.

    .venv/bin/python bench/start/run.py [--services 10000] [--endpoints 10] [--runs 5]
        [--modes iptables,nftables] [--formats json,yaml] [--no-agent] [--nice -20]

Writes a `kind: List` manifest of synthetic Services x endpoints (one port
each) in JSON and in YAML (as `kubectl -o json|yaml` would), then runs
`clusterdns rules --mode M --manifest F >/dev/null` --runs times for each mode
and format (interleaved) and prints, with the command, the median wall time, CPU
time (user+sys, the process and its children: steadier than wall on a shared
machine), peak RSS and how busy the machine was.

The agent part runs, in a fresh process per run, what `clusterdns agent
--proxy-mode nftables` does before its first sync: the manifest source's first
load (the parse worker, then the records into the store), the DNS zone, and
the first full nftables render; it prints the median of each step and the
peak RSS of the agent's process and of the parse worker apart.

--nice N runs the measured processes at that niceness (as root, -20): on a
machine shared with other work the figures are then much steadier, close to
an idle machine's (a big YAML manifest is still parsed in one process while
other tasks wait for a CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLUSTERDNS = os.path.join(os.path.dirname(sys.executable), "clusterdns")

AGENT_STEPS = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from clusterdns.config import load
from clusterdns.sources.loader import make_source
from clusterdns.state import StateStore
cfg = load(["agent", "--manifest", sys.argv[1], "--node-name", "node-0", "--node-ip", "192.168.0.2",
            "--dry-run"], env={})
t1 = time.perf_counter()
store = StateStore()
make_source(cfg, store)                      # the first load, as the agent's start does
t2 = time.perf_counter()
from clusterdns.dns.zone import ZoneView
ZoneView(cfg, store.current)
t3 = time.perf_counter()
from clusterdns.proxy import nftables
nftables.render(store.current, cfg, 4)      # the first full render of an agent in nftables mode
t4 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "source": t2 - t1, "zone": t3 - t2, "nftables": t4 - t3,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


WRITE = r"""
import json, sys, yaml
from clusterdns.synthetic import synthetic_records, to_manifest
text = to_manifest(synthetic_records(services=int(sys.argv[1]), endpoints=int(sys.argv[2])))
open(sys.argv[3], "w").write(text)
with open(sys.argv[4], "w") as fh:
    yaml.dump(json.loads(text), fh, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), default_flow_style=False)
"""


def write_manifests(services: int, endpoints: int, where: str) -> dict[str, str]:
    """In a child process: this one stays small, so the RSS its children report is their own."""
    paths = {"json": os.path.join(where, "cluster.json"), "yaml": os.path.join(where, "cluster.yaml")}
    subprocess.run([sys.executable, "-c", WRITE, str(services), str(endpoints), paths["json"], paths["yaml"]],
                   check=True)
    return paths


def others_runnable() -> int:
    """Tasks other than this one wanting a CPU now (/proc/loadavg): on a shared machine the
    figures are only comparable at the same load, and a big YAML manifest is parsed in two
    processes only when a CPU is idle."""
    try:
        with open("/proc/loadavg") as fh:
            return int(fh.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        return -1


NICE = 0


def _niced() -> None:
    if NICE:
        os.nice(NICE)


def run_once(cmd: list[str]) -> tuple[float, float, float, int]:
    """(wall s, CPU s, peak RSS MB, other runnable tasks at its start) of one whole process
    (its own rusage and its children's, through wait4)."""
    busy = others_runnable()
    start = time.perf_counter()
    with open(os.devnull, "wb") as null, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=null, stderr=err, preexec_fn=_niced)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.read().decode()[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, busy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", default="iptables,nftables")
    ap.add_argument("--formats", default="json,yaml")
    ap.add_argument("--no-agent", action="store_true")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the measured processes (-20: steadier)")
    args = ap.parse_args()
    global NICE
    NICE = args.nice
    with tempfile.TemporaryDirectory(prefix="clusterdns-start-") as tmp:
        paths = write_manifests(args.services, args.endpoints, tmp)
        sizes = {f: os.path.getsize(p) / 1e6 for f, p in paths.items()}
        print(f"{args.services} Services x {args.endpoints} endpoints; manifests: "
              + ", ".join(f"{f} {sizes[f]:.1f} MB" for f in paths) + f"; {args.runs} runs each, medians"
              + (f"; niceness {args.nice}" if args.nice else ""))
        print(f"{'mode':<9} {'format':<6} {'wall s':>7} {'cpu s':>7} {'peak MB':>8} {'busy':>5}  command")
        cases = [(mode, fmt) for mode in args.modes.split(",") for fmt in args.formats.split(",")]
        runs: dict[tuple[str, str], list] = {case: [] for case in cases}
        for _ in range(args.runs):   # interleaved: a burst of load elsewhere spreads over every case
            for mode, fmt in cases:
                runs[mode, fmt].append(run_once([CLUSTERDNS, "rules", "--mode", mode, "--manifest", paths[fmt]]))
        for mode, fmt in cases:
            wall, cpu, rss, busy = (statistics.median(r[i] for r in runs[mode, fmt]) for i in range(4))
            cmd = [CLUSTERDNS, "rules", "--mode", mode, "--manifest", paths[fmt]]
            shown = " ".join(cmd).replace(tmp, "$TMP").replace(CLUSTERDNS, "clusterdns")
            print(f"{mode:<9} {fmt:<6} {wall:7.2f} {cpu:7.2f} {rss:8.0f} {busy:5.0f}  {shown} >/dev/null", flush=True)
        print("(busy: the median count of other runnable tasks when a run started; "
              "0 on an idle machine)")
        if args.no_agent:
            return 0
        print("\nagent start path (first load through the parse worker, DNS zone, first nftables render), medians:")
        for fmt in args.formats.split(","):
            got = []
            for _ in range(args.runs):
                out = subprocess.run([sys.executable, "-c", AGENT_STEPS, paths[fmt]], capture_output=True, preexec_fn=_niced,
                                     text=True, check=False)
                if out.returncode != 0:
                    sys.exit(f"agent steps failed: {out.stderr[-800:]}")
                got.append(json.loads(out.stdout.strip().splitlines()[-1]))
            med = {k: statistics.median(g[k] for g in got) for k in got[0]}
            total = med["imports"] + med["source"] + med["zone"] + med["nftables"]
            print(f"  {fmt}: imports {med['imports']:.2f} s, source first load {med['source']:.2f} s, "
                  f"zone {med['zone']:.2f} s, nftables render {med['nftables']:.2f} s (sum {total:.2f} s); "
                  f"peak RSS agent {med['rss_mb']:.0f} MB, parse worker {med['worker_rss_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
