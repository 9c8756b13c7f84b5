#!/usr/bin/env python3
"""DNS benchmark of the setup a user gets, next to unbound in the same run.

    python3 bench/dns/user.py [--rounds 3] [--venv DIR] [--workers N] [--no-start]
    python3 bench/dns/user.py --start-only [--starts 5] [--venv DIR]   # step 4 alone (~1 min)
    python3 bench/dns/user.py --corefile FILE [--no-start]   # also clusterdns serving FILE

1. `pip install .` of this tree into a fresh venv (no extras: only what the
   package requires), unless --venv names one to reuse.
2. `clusterdns dns --manifest FILE --listen 127.0.0.1:PORT --no-upstream` from
   that venv on 1,000 Services (10% headless, 10 endpoints each), metrics and
   health on as by default (on free ports); unbound serving the same names as
   local-data (one thread).
3. One pass of every distinct query of both mixes against each server, then
   alternating rounds of `dnsperf -c 8 -t 2 -l 8` on the mix (A/AAAA/SRV/PTR/
   NXDOMAIN) and on the search-path mix (the ndots:5 walk of a pod). Prints
   medians of queries per server CPU-second, the ratio to unbound, and loss.
   With --corefile FILE (e.g. kubeadm's Corefile), a third server in the same rounds:
   `clusterdns dns --manifest FILE --corefile C` where C is FILE with its port 53
   made the bench's port, `bind 127.0.0.1` added and health/ready/prometheus moved
   to free loopback ports: nothing else of it changed.
4. Start and memory at 10,000 Services / 100,000 endpoints: seconds from
   exec to the first answer, and RSS once answering and after one pass of every
   distinct query of both mixes; medians of --starts runs.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import re  # noqa: E402

from run import (  # noqa: E402
    build_state,
    cpu_seconds,
    free_port,
    query_files,
    rss_mib,
    start_unbound,
    wait_answering,
)

from clusterdns.synthetic import to_manifest  # noqa: E402


def make_venv(path: Path) -> Path:
    """A fresh venv with `pip install .` of this tree (a copy, so no build output lands in it)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    src = path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__",
                                                             "build", ".pytest_cache", ".mypy_cache"))
    r = subprocess.run([str(path / "bin" / "pip"), "install", "-q", str(src)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"pip install . failed:\n{r.stdout}{r.stderr}")
    return path / "bin" / "clusterdns"


def dnsperf(port: int, data: Path, pid: int, seconds: float = 8, passes: int = 0) -> dict:
    argv = ["dnsperf", "-s", "127.0.0.1", "-p", str(port), "-d", str(data), "-c", "8", "-t", "2"]
    argv += ["-n", str(passes)] if passes else ["-l", str(seconds)]
    before = cpu_seconds(pid)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 300).stdout
    cpu = cpu_seconds(pid) - before

    def num(pattern: str) -> float:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else 0.0
    sent, done, lost = num(r"Queries sent:\s+(\d+)"), num(r"Queries completed:\s+(\d+)"), num(r"Queries lost:\s+(\d+)")
    return {"qps": num(r"Queries per second:\s+([\d.]+)"), "loss": 100.0 * lost / sent if sent else 100.0,
            "cpu": cpu, "per_cpu": done / cpu if cpu > 0 else 0.0}


def distinct(files: list[Path], out: Path) -> Path:
    seen = dict.fromkeys(line for f in files for line in f.read_text().splitlines() if line)
    out.write_text("\n".join(seen) + "\n")
    return out


def start_server(exe: Path, manifest: Path, port: int, workers: int) -> subprocess.Popen:
    argv = [str(exe), "dns", "--manifest", str(manifest), "--listen", f"127.0.0.1:{port}", "--no-upstream",
            "--metrics-listen", f"127.0.0.1:{free_port()}", "--health-listen", f"127.0.0.1:{free_port()}"]
    if workers > 1:
        argv += ["--workers", str(workers)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")


def localize_corefile(text: str, port: int) -> str:
    """The Corefile on loopback: `:53` keys on `port`, `bind 127.0.0.1` in each block, its
    health/ready/prometheus on free ports."""
    text = re.sub(r"^(\S+?):53(\s*\{)", lambda m: f"{m.group(1)}:{port}{m.group(2)}\n    bind 127.0.0.1",
                  text, flags=re.M)
    text = re.sub(r"^(\s*)health(\s+[^\s{]+)?(\s*\{|\s*$)", lambda m: f"{m.group(1)}health 127.0.0.1:{free_port()}{m.group(3)}",
                  text, flags=re.M)
    text = re.sub(r"^(\s*)ready(\s+[^\s{]+)?\s*$", lambda m: f"{m.group(1)}ready 127.0.0.1:{free_port()}", text, flags=re.M)
    text = re.sub(r"^(\s*)prometheus(\s+[^\s{]+)?\s*$", lambda m: f"{m.group(1)}prometheus 127.0.0.1:{free_port()}",
                  text, flags=re.M)
    return text


def start_corefile_server(exe: Path, manifest: Path, corefile: Path, workers: int) -> subprocess.Popen:
    argv = [str(exe), "dns", "--manifest", str(manifest), "--corefile", str(corefile)]
    if workers > 1:
        argv += ["--workers", str(workers)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")


def first_answer(exe: Path, manifest: Path, probe: str, workers: int) -> tuple[float, float, subprocess.Popen, int]:
    """Seconds from exec to the first positive answer (polled every 10 ms), RSS then."""
    import dns.message
    import dns.query
    port = free_port()
    q = dns.message.make_query(probe, "A")
    t0 = time.monotonic()
    p = start_server(exe, manifest, port, workers)
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"server exited with {p.returncode}")
        try:
            r = dns.query.udp(q, "127.0.0.1", port=port, timeout=0.01)
            if r.answer:
                break
        except Exception:
            pass
        if time.monotonic() - t0 > 120:
            raise RuntimeError("no answer within 120 s")
    return time.monotonic() - t0, rss_mib(p.pid), p, port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--venv", type=Path, help="reuse this venv (made by an earlier run) instead of a fresh one")
    ap.add_argument("--workers", type=int, default=1, help="clusterdns --workers N")
    ap.add_argument("--no-start", action="store_true", help="skip the 10,000-Service start/RSS measurement")
    ap.add_argument("--start-only", action="store_true", help="only the 10,000-Service start/RSS measurement")
    ap.add_argument("--starts", type=int, default=3, help="starts at 10,000 Services (medians)")
    ap.add_argument("--corefile", type=Path, help="also serve this Corefile (localized to loopback) in the rounds")
    args = ap.parse_args()
    for tool in ("dnsperf", "unbound"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (Debian package {tool})", file=sys.stderr)
            return 2
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="clusterdns-bench-user-") as d:
        tmp = Path(d)
        try:
            if args.venv and (args.venv / "bin" / "clusterdns").exists():
                exe = args.venv / "bin" / "clusterdns"
            else:
                t = time.monotonic()
                exe = make_venv(args.venv or tmp / "venv")
                print(f"pip install . into a fresh venv: {time.monotonic() - t:.0f} s")
            mods = subprocess.run([str(exe.parent / "python"), "-c",
                                   "import uvloop, clusterdns; print(uvloop.__version__)"],
                                  capture_output=True, text=True)
            print(f"venv {exe.parent.parent}: uvloop {mods.stdout.strip() or 'MISSING'}")

            if not args.start_only:
                throughput(args, exe, tmp, procs)
            if args.no_start:
                return 0
            start_and_memory(args, exe, tmp, procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    return 0


def throughput(args, exe: Path, tmp: Path, procs: list[subprocess.Popen]) -> None:
    """Steps 2 and 3: queries per server CPU-second next to unbound."""
    records, svcs, slices = build_state(args.services, 10)
    manifest = tmp / "state.json"
    manifest.write_text(to_manifest(records))
    files = query_files(tmp, svcs, slices)
    mixes = {"mix": files["mix"], "search": files["search"]}
    every = distinct(list(mixes.values()), tmp / "distinct.txt")
    probe = f"{svcs[1].name}.{svcs[1].namespace}.svc.cluster.local."

    uport, u = start_unbound(tmp, svcs, slices)
    procs.append(u)
    port = free_port()
    p = start_server(exe, manifest, port, args.workers)
    procs.append(p)
    wait_answering(uport, u, probe)
    wait_answering(port, p, probe)
    servers = {"clusterdns": (port, p), "unbound": (uport, u)}
    if args.corefile:
        cport = free_port()
        local = tmp / "Corefile"
        local.write_text(localize_corefile(args.corefile.read_text(), cport))
        c = start_corefile_server(exe, manifest, local, args.workers)
        procs.append(c)
        wait_answering(cport, c, probe)
        servers = {"clusterdns": (port, p), "corefile": (cport, c), "unbound": (uport, u)}
    for name, (prt, proc) in servers.items():
        dnsperf(prt, every, proc.pid, passes=1)
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for mix, f in mixes.items():
            for name, (prt, proc) in servers.items():
                results.setdefault((name, mix), []).append(dnsperf(prt, f, proc.pid, args.seconds))
    print(f"\n{args.services} services, `dnsperf -c 8 -t 2 -l {args.seconds:g}`, median of {args.rounds} rounds"
          f" (clusterdns --workers {args.workers}):")
    if args.corefile:
        print(f"(corefile: clusterdns dns --corefile {args.corefile}, localized to loopback)")
    print(f"{'server':<11} {'mix':<7} {'qps':>9} {'q/CPU-s':>9} {'loss %':>7} {'ratio':>6}   per-round q/CPU-s")
    for mix in mixes:
        base = statistics.median(r["per_cpu"] for r in results[("unbound", mix)])
        for name in servers:
            rs = results[(name, mix)]
            per = statistics.median(r["per_cpu"] for r in rs)
            ratio = f"{per / base:.2f}" if name != "unbound" and base else ""
            print(f"{name:<11} {mix:<7} {statistics.median(r['qps'] for r in rs):>9.0f} {per:>9.0f} "
                  f"{max(r['loss'] for r in rs):>7.3f} {ratio:>6}   "
                  + " ".join(f"{r['per_cpu']:.0f}" for r in rs))
    print("(loss: the worst round)")
    print(f"clusterdns RSS at {args.services} services: {rss_mib(p.pid):.0f} MiB; "
          f"unbound {rss_mib(u.pid):.0f} MiB")
    for _name, (_prt, proc) in servers.items():
        proc.terminate()
        proc.wait(timeout=15)


def start_and_memory(args, exe: Path, tmp: Path, procs: list[subprocess.Popen]) -> None:
    """Step 4: seconds from exec to the first answer and RSS, at 10,000 Services / 100,000 endpoints."""
    records, svcs, slices = build_state(10_000, 10)
    big = tmp / "big.json"
    big.write_text(to_manifest(records))
    files = query_files(tmp, svcs, slices, n=20_000)
    every = distinct([files["mix"], files["search"]], tmp / "distinct-big.txt")
    n_every = sum(1 for _ in every.open())
    probe = f"{svcs[1].name}.{svcs[1].namespace}.svc.cluster.local."
    starts, rss0, rss1 = [], [], []
    for _ in range(args.starts):
        secs, rss, proc, prt = first_answer(exe, big, probe, args.workers)
        procs.append(proc)
        starts.append(secs)
        rss0.append(rss)
        time.sleep(2)          # anything still loading after the first answer
        dnsperf(prt, every, proc.pid, passes=1)
        rss1.append(rss_mib(proc.pid))
        proc.terminate()
        proc.wait(timeout=15)
    print(f"\n10000 services / 100000 endpoints ({big.stat().st_size / 1e6:.0f} MB manifest), {args.starts} starts:")
    print(f"  first answer after exec: median {statistics.median(starts):.2f} s  "
          f"({' '.join(f'{s:.2f}' for s in starts)})")
    print(f"  RSS at the first answer: median {statistics.median(rss0):.0f} MiB; 2 s later and after one pass "
          f"of every distinct query ({n_every}): median {statistics.median(rss1):.0f} MiB "
          f"({' '.join(f'{r:.0f}' for r in rss1)})")


if __name__ == "__main__":
    sys.exit(main())
