#!/usr/bin/env python3
"""The server's socket loop with a trivial engine, to see what the loop itself costs.

    python3 bench/dns/loop_server.py --port 5300 [--no-stats]

The engine answers every query on the fast path with the query's own bytes and
QR set, so dnsperf measures DnsService + asyncio/uvloop alone. --no-stats
removes the per-query counting to show what it costs.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from clusterdns.config import load  # noqa: E402
from clusterdns.dns import metrics  # noqa: E402
from clusterdns.dns.server import DnsService  # noqa: E402
from clusterdns.state import StateStore  # noqa: E402


class EchoEngine:
    synced = True

    def update(self, state) -> None:
        pass

    def fast(self, data: bytes, tcp: bool) -> bytes | None:
        return data[:2] + bytes((data[2] | 0x80,)) + data[3:] if len(data) > 12 else None

    async def resolve(self, data: bytes, client_ip: str, tcp: bool):
        return data[:2] + bytes((data[2] | 0x80,)) + data[3:] if len(data) > 12 else None


class SlowPathEngine(EchoEngine):
    """Everything through resolve(): the cost of the task the server starts per query."""

    def fast(self, data: bytes, tcp: bool) -> bytes | None:
        return None


async def main(port: int, engine) -> None:
    cfg = load(["dns", "--manifest", "-", "--listen", f"127.0.0.1:{port}", "--no-upstream",
                "--metrics-listen", "none", "--health-listen", "none"])
    service = DnsService(cfg, StateStore(), engine=engine)
    await service.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--no-stats", action="store_true")
    ap.add_argument("--slow", action="store_true", help="answer through resolve() instead of fast()")
    args = ap.parse_args()
    if args.no_stats:
        # The same UDP path without any counting, to see what counting costs.
        metrics.ServerStats.fast_udp = lambda self, data, reply, started: None
        metrics.ServerStats.record = lambda self, data, reply, tcp, started, part=0: None
    engine = SlowPathEngine() if args.slow else EchoEngine()
    import uvloop
    uvloop.run(main(args.port, engine))
