#!/usr/bin/env python3
"""What counting one UDP fast-path answer costs (coredns_dns_* per query), in ns per query.

    python3 bench/metrics/counting.py

Peers measured in the same run, medians of 7 rounds of 200,000 calls:
- "untimed": the count the server did before every query was timed (one dict
  update keyed on bytes of the two packets, inline, no clock; one query in 32
  was timed separately);
- "timed": ServerStats.fast_udp, what the server calls now (clock read,
  duration bucket and sum, DO bit, one dict update);
- "call": an empty function call with the same arguments (the floor).
"""
from __future__ import annotations

import statistics
import sys
import timeit
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dns.message  # noqa: E402

from clusterdns.dns import metrics  # noqa: E402


def main() -> None:
    for edns in (False, True):
        q = dns.message.make_query("testapp-svc.testapp.svc.cluster.local.", "A",
                                   use_edns=0 if edns else None).to_wire()
        r = q[:2] + b"\x85\x00" + q[4:]
        table: dict = {}

        def untimed(data: bytes = q, reply: bytes = r) -> None:
            i = data.find(0, 12)
            try:
                key = (data[i + 1], data[i + 2], reply[2], reply[3], len(data), len(reply))
            except IndexError:
                key = (255, 255, -1, -1, len(data), 0)
            v = table.get(key)
            if v is None:
                table[key] = 1
            else:
                table[key] = v + 1

        timed = metrics.ServerStats("dns://bench", 1).fast_udp

        def call(data: bytes, reply: bytes, started: float) -> None:
            pass

        runs = {"untimed": lambda: untimed(q, r), "timed": lambda: timed(q, r, perf_counter()),
                "call": lambda: call(q, r, perf_counter())}
        n = 200_000
        res: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(7):
            for k, fn in runs.items():
                res[k].append(timeit.timeit(fn, number=n) / n * 1e9)
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"EDNS {'yes' if edns else 'no '}: " + ", ".join(f"{k} {v:.0f} ns" for k, v in med.items())
              + f"; timed - untimed = {med['timed'] - med['untimed']:.0f} ns per query")


if __name__ == "__main__":
    main()
