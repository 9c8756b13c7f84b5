"""Forward's Corefile-driven knobs used directly (the flag-driven defaults are test_forward's):
ask() failing with ForwardFailed / ForwardRefused, query()'s REFUSED beyond max_concurrent,
the policies' orders, max_fails 0, and a bad policy name."""
from __future__ import annotations

import asyncio

import dnslib
import pytest

from clusterdns.dns.forward import Forward, ForwardFailed, ForwardRefused, Upstream
from tests.dns.dnskit import RECORDS, FakeUpstream, closed_port


def q(name: str = "www.example") -> dnslib.DNSRecord:
    return dnslib.DNSRecord.question(name, "A")


async def test_ask_answers_with_the_request_id_and_question():
    up = await FakeUpstream(RECORDS).start()
    try:
        fwd = Forward([up.address], None, max_concurrent=0)
        req = q("WWW.example")
        reply = await fwd.ask(req, False)
        assert reply.header.id == req.header.id and str(reply.q.qname) == "WWW.example."
        assert str(reply.rr[0].rdata) == "192.0.2.1"
    finally:
        await up.stop()


async def test_ask_fails_with_the_last_reason():
    port = closed_port()
    fwd = Forward([("127.0.0.1", port)], None, health_interval=30)
    with pytest.raises(ForwardFailed) as exc:
        await fwd.ask(q(), False)
    assert f"127.0.0.1:{port}" in str(exc.value) and "ConnectionRefusedError" in str(exc.value)
    await fwd.close()


async def test_beyond_max_concurrent_ask_is_refused_and_query_answers_refused():
    slow = await FakeUpstream(RECORDS, delay=0.3).start()
    try:
        fwd = Forward([slow.address], None, max_concurrent=1)
        first = asyncio.ensure_future(fwd.ask(q(), False))
        await asyncio.sleep(0.05)
        with pytest.raises(ForwardRefused):
            await fwd.ask(q(), False)
        refused = await fwd.query(q(), False)          # the flag-driven path: a REFUSED reply
        assert refused is not None and refused.header.rcode == dnslib.RCODE.REFUSED
        assert str((await first).rr[0].rdata) == "192.0.2.1"
        assert fwd.upstreams[0].fails == 0
    finally:
        await slow.stop()


def test_policy_orders():
    ups = [Upstream("127.0.0.1", p) for p in (1, 2, 3)]
    rr = Forward(ups, None, policy="round_robin")
    assert [[u.port for u in rr._order("x.")] for _ in range(4)] == [[2, 1, 3], [3, 1, 2], [1, 2, 3], [2, 1, 3]]
    seq = Forward(ups, None, policy="sequential")
    ups[0].fails = seq.max_fails                       # down: tried last, the others keep their order
    assert [u.port for u in seq._order("x.")] == [2, 3, 1]
    never = Forward(ups, None, policy="sequential", max_fails=0)
    assert never.healthy(ups[0]) and [u.port for u in never._order("x.")] == [1, 2, 3]
    with pytest.raises(ValueError):
        Forward(ups, None, policy="fastest")
