"""Serving a Corefile in-process on loopback for tests, on the demo cluster's state.

    async with CorefileServer(".:{PORT} {\n bind 127.0.0.1\n kubernetes cluster.local\n}", tmp_path) as s:
        r = await s.ask("testapp-svc.testapp.svc.cluster.local", "A")

`{PORT}` (and `{PORT2}`, `{PORT3}`) in the text become free loopback ports (s.port, s.ports);
`files` are written beside the Corefile (hosts files, imports); `records` replace the demo
state; `options` are flags (Config option names) of the process.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import dns.asyncquery
import dns.message
import dns.rdatatype

from clusterdns.config import Config
from clusterdns.corefile.build import Corefile, load_corefile
from clusterdns.dns.server import DnsService
from clusterdns.sources.manifest import publish
from clusterdns.state import StateStore
from tests import demo
from tests.netutil import free_port


class CorefileServer:
    def __init__(self, text: str, tmp_path: Path, *, records=None, files: dict[str, str] | None = None,
                 env: dict[str, str] | None = None, **options) -> None:
        self.ports = [free_port() for _ in range(3)]
        self.port = self.ports[0]
        for i, name in enumerate(("{PORT}", "{PORT2}", "{PORT3}")):
            text = text.replace(name, str(self.ports[i]))
        self.dir = tmp_path
        for name, body in (files or {}).items():
            p = tmp_path / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(body)
        self.path = tmp_path / "Corefile"
        self.path.write_text(text)
        self.env = env or {}
        self.records = demo.demo_records() if records is None else records
        self.cfg = Config.from_options("dns", corefile=str(self.path), **options)
        self.corefile: Corefile | None = None
        self.service: DnsService | None = None
        self.store = StateStore()

    async def __aenter__(self) -> "CorefileServer":
        self.corefile = load_corefile(str(self.path), self.cfg, env=self.env)
        publish(self.store, self.records)
        self.service = DnsService(self.cfg, self.store, corefile=self.corefile)
        await self.service.start()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service.detach()

    async def ask(self, name: str, qtype: str = "A", *, tcp: bool = False, port: int | None = None,
                  host: str = "127.0.0.1", timeout: float = 3.0, **kw) -> dns.message.Message:
        q = dns.message.make_query(name, qtype, **kw)
        port = port or self.port
        if tcp:
            return await dns.asyncquery.tcp(q, host, port=port, timeout=timeout)
        return await dns.asyncquery.udp(q, host, port=port, timeout=timeout, ignore_trailing=True)

    def publish(self, records) -> None:
        publish(self.store, records)

    async def settle(self, seconds: float = 0.05) -> None:
        await asyncio.sleep(seconds)


def answers(msg: dns.message.Message) -> list[str]:
    """The answer section as `name TTL type rdata` lines without the TTL (stable in tests)."""
    out = []
    for rrset in msg.answer:
        for rd in rrset:
            out.append(f"{rrset.name} {dns.rdatatype.to_text(rrset.rdtype)} {rd.to_text()}")
    return out
