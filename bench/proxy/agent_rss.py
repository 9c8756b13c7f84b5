"""Peak memory of `clusterdns agent --apply` at scale, as an operator's pod limit sees it.

    sudo python3 bench/proxy/agent_rss.py [--services 10000] [--endpoints 10] [--runs 3] [--changes 3]
                                          [--mode nftables] [--restart]

Each run: a JSON `kind: List` manifest from clusterdns.synthetic, a scratch
network namespace (created and deleted here), and
`clusterdns agent --manifest F --apply --proxy-mode MODE` in it (DNS on a
loopback port of the namespace). Memory is read from /proc:
* the agent's VmHWM (its own peak RSS) once the first sync is in, and again
  after `--changes` one-endpoint changes (the manifest rewritten, each waited
  for: the proxier's sync count goes up);
* the peak of the summed PSS of the agent and every child it has at the same
  time (the manifest parse worker, nft, conntrack), sampled every 20 ms: what
  a pod's memory limit counts (a cgroup's total), short of page cache. PSS,
  not RSS: a child between fork and exec shares all of the agent's pages,
  and summed RSS counted them twice;
* the agent's VmRSS at the end (what it keeps);
* with --restart, the same peaks for a second agent started on the rules the
  first left (it reads them back before its first sync: restart adoption).
Prints the medians of --runs runs (min, max): the machine is shared. Not
covered: the hourly full resync (in place, beside the previous state), whose
peak is ~20 MB above the steady RSS at 10,000 x 10 (measured in process).
Figures: docs/proxy-runtime.md, "Memory".
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from clusterdns.synthetic import synthetic_records, to_manifest  # noqa: E402

CLONE_NEWNET = 0x40000000


def status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_kb(pid: int) -> int:
    """Proportional set size: a page shared by n processes counts 1/n in each (a fork before
    its exec shares all of the agent's pages; summed RSS would count them twice)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


class Sampler(threading.Thread):
    """The peak of the summed PSS of a process tree (what its cgroup is charged, short of page
    cache), and each child's own peak RSS."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_kb = 0
        self.child_hwm: dict[int, int] = {}
        self.child_cmd: dict[int, str] = {}
        self.stop = threading.Event()
        self.timeline: list[tuple[float, int, int]] = []   # (time, agent RSS, children RSS) in kB

    def run(self) -> None:
        while not self.stop.is_set():
            pids = tree(self.pid)
            pss = [pss_kb(p) for p in pids]
            total = sum(pss)
            self.timeline.append((time.monotonic(), pss[0], total - pss[0]))
            self.peak_kb = max(self.peak_kb, total)
            for p in pids[1:]:
                self.child_hwm[p] = max(self.child_hwm.get(p, 0), status_kb(p, "VmHWM"))
                if p not in self.child_cmd:
                    try:
                        with open(f"/proc/{p}/cmdline", "rb") as f:
                            self.child_cmd[p] = f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
                    except OSError:
                        pass
            time.sleep(0.02)


def enter_netns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}", "rb") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")


def syncs(metrics: str, ns: str) -> int:
    """The proxier's sync count, read from its metrics inside the namespace (setns is per thread)."""
    got: list = []

    def fetch() -> None:
        try:
            enter_netns(ns)
            with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=2) as r:
                got.append(r.read().decode())
        except OSError:
            pass

    t = threading.Thread(target=fetch)
    t.start()
    t.join()
    if not got:
        return -1
    text = got[0]
    m = re.search(r"^kubeproxy_sync_proxy_rules_duration_seconds_count(?:\{[^}]*\})? (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def wait_syncs(metrics: str, ns: str, proc: subprocess.Popen, above: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited ({proc.returncode})")
        n = syncs(metrics, ns)
        if n > above:
            return n
        time.sleep(0.1)
    raise SystemExit(f"no sync past {above} within {timeout:.0f} s")


def change_manifest(path: str, doc: dict, i: int) -> None:
    """One endpoint of one EndpointSlice gets a new address; the file is replaced atomically."""
    slices = [it for it in doc["items"] if it["kind"] == "EndpointSlice"]
    sl = slices[(i * 7919) % len(slices)]
    sl["endpoints"][0]["addresses"] = [f"10.250.{i // 250}.{i % 250 + 1}"]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def one_run(args, manifest: str, doc: dict, run: int) -> dict:
    ns = f"cdns-rss-{os.getpid()}-{run}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    with open(manifest, "w") as f:
        json.dump(doc, f)
    metrics = "127.0.0.1:18196"
    argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "clusterdns", "agent", "--manifest", manifest,
            "--apply", "--proxy-mode", args.mode, "--listen", "127.0.0.1:5398", "--no-upstream",
            "--proxy-metrics-listen", metrics, "--metrics-listen", "127.0.0.1:18197",
            "--health-listen", "127.0.0.1:18198", "--node-name", "node-0", "--log-level", "warning",
            "--lameduck", "0"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)   # `ip netns exec` execs the agent: the same pid
    sampler.start()
    out: dict = {}
    try:
        n = wait_syncs(metrics, ns, proc, 0, 600)
        out["first_sync_s"] = time.monotonic() - t0
        out["hwm_first"] = status_kb(proc.pid, "VmHWM")
        out["tree_first"] = sampler.peak_kb
        for i in range(args.changes):
            time.sleep(1.5)   # the manifest source settles a changed file before reading it
            change_manifest(manifest, doc, run * 100 + i)
            n = wait_syncs(metrics, ns, proc, n, 120)
        time.sleep(0.5)
        out["hwm_after"] = status_kb(proc.pid, "VmHWM")
        out["tree_after"] = sampler.peak_kb
        out["rss_end"] = status_kb(proc.pid, "VmRSS")
        out["child_hwm"] = max(sampler.child_hwm.values(), default=0)
        out["children"] = sorted(((kb // 1024, sampler.child_cmd.get(p, "?")) for p, kb in sampler.child_hwm.items()),
                                 reverse=True)
        if args.timeline:
            with open(args.timeline, "a") as f:
                for t, a, c in sampler.timeline:
                    f.write(f"{run} {t - t0:.2f} {a // 1024} {c // 1024}\n")
        sampler.stop.set()
        err = stop(proc)
        if args.restart:
            # a new agent with the rules in place: it adopts them (reads the table back) first
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            sampler = Sampler(proc.pid)
            sampler.start()
            wait_syncs(metrics, ns, proc, 0, 600)
            time.sleep(0.5)
            out["hwm_restart"] = status_kb(proc.pid, "VmHWM")
            out["tree_restart"] = sampler.peak_kb
    finally:
        sampler.stop.set()
        err = stop(proc)
        subprocess.run(["ip", "netns", "del", ns], check=False)
    if not out.get("rss_end"):
        sys.stderr.write(err[-3000:])
    return out


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.communicate(timeout=60)[1] or ""
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1] or ""
    except ValueError:     # already read
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--changes", type=int, default=3)
    ap.add_argument("--mode", default="nftables", choices=("nftables", "iptables"))
    ap.add_argument("--restart", action="store_true",
                    help="then restart the agent with the rules in place and measure its first sync too")
    ap.add_argument("--timeline", help="append 'run seconds agentMB childrenMB' (PSS) samples to this file")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespace, nftables)", file=sys.stderr)
        return 2
    print("command: python3 bench/proxy/agent_rss.py " + " ".join(sys.argv[1:]))
    doc = json.loads(to_manifest(synthetic_records(services=args.services, endpoints=args.endpoints)))
    results = []
    with tempfile.TemporaryDirectory(prefix="cdns-rss-") as tmp:
        manifest = os.path.join(tmp, "cluster.json")
        for run in range(args.runs):
            r = one_run(args, manifest, doc, run)
            results.append(r)
            print(f"run {run + 1}: first sync {r['first_sync_s']:.1f} s; agent VmHWM {r['hwm_first'] / 1024:.0f} MB "
                  f"after it, {r['hwm_after'] / 1024:.0f} MB after {args.changes} changes; agent+children PSS peak "
                  f"{r['tree_after'] / 1024:.0f} MB (largest child: {r['children'][0][1].split(' -m ')[-1][:40] if r['children'] else '-'}, own peak {r['child_hwm'] / 1024:.0f} MB); "
                  f"RSS kept {r['rss_end'] / 1024:.0f} MB", flush=True)

    def med(key: str, unit: float = 1024, fmt: str = "{:.0f} MB") -> str:
        vals = [r[key] / unit for r in results]
        return (fmt.format(statistics.median(vals)) + f" (min {fmt.format(min(vals))}, max {fmt.format(max(vals))},"
                f" n={len(vals)})")

    print(f"{args.services} Services x {args.endpoints} endpoints, {args.mode}, medians:")
    print(f"  agent peak RSS (VmHWM) after the first sync:         {med('hwm_first')}")
    print(f"  agent peak RSS (VmHWM) after {args.changes} endpoint changes:     {med('hwm_after')}")
    print(f"  agent + children, summed PSS peak (pod total):       {med('tree_after')}")
    print(f"  agent RSS kept after the changes:                    {med('rss_end')}")
    print(f"  first sync in after start:                           {med('first_sync_s', 1, '{:.1f} s')}")
    if args.restart:
        print(f"  restarted agent (rules in place), VmHWM:             {med('hwm_restart')}")
        print(f"  restarted agent + children, summed PSS peak:         {med('tree_restart')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
