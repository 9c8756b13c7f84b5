"""The hosts plugin, pinned to coredns/coredns plugin/hosts (hosts_test.go, hostsfile_test.go,
setup_test.go, README): lookups, fall through, PTR, options, setup errors with FILE:LINE,
reloads off the event loop."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import dnslib
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterdns.corefile.plugin import PluginError, Request, SetupContext
from clusterdns.corefile.plugins import hosts as hostsmod
from clusterdns.corefile.plugins.hosts import setup
from clusterdns.corefile.syntax import CorefileError
from tests.corefile.cfplugkit import directive

MARK = "next-was-called"


class Next:
    """A next plugin that records the requests it got and answers a marker TXT."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, req: Request) -> dnslib.DNSRecord:
        self.calls.append(req.qname)
        r = req.reply(aa=False)
        r.add_answer(dnslib.RR(req.qname, dnslib.QTYPE.TXT, rdata=dnslib.TXT(MARK)))
        return r


def make(text: str, tmp_path, zones=(".",), files: dict[str, str] | None = None):
    for name, body in (files or {}).items():
        (tmp_path / name).write_text(body)
    ctx = SetupContext(zones=list(zones), base_dir=str(tmp_path))
    return setup(directive(text), ctx)


async def ask(plugin, name: str, qtype: str = "A"):
    """(rcode or 'next', answers as text, reply) for one question."""
    nxt = Next()
    req = Request(record=dnslib.DNSRecord.question(name, qtype))
    try:
        reply = await plugin.serve(req, nxt)
    except PluginError as exc:
        return exc.rcode, [], None
    if nxt.calls:
        return "next", [], reply
    return reply.header.rcode, [f"{rr.rname} {rr.ttl} {dnslib.QTYPE[rr.rtype]} {rr.rdata}" for rr in reply.rr], reply


HOSTS_EXAMPLE = """
127.0.0.1 localhost localhost.domain
::1 localhost localhost.domain
10.0.0.1 example.org
::FFFF:10.0.0.2 example.com
"""


async def test_lookups_of_corednss_hosts_example(tmp_path):
    h = make("hosts hosts.txt", tmp_path, files={"hosts.txt": HOSTS_EXAMPLE})
    assert (await ask(h, "example.org.", "A"))[:2] == (0, ["example.org. 3600 A 10.0.0.1"])
    # an IPv4-mapped IPv6 address is IPv4
    assert (await ask(h, "example.com.", "A"))[:2] == (0, ["example.com. 3600 A 10.0.0.2"])
    assert (await ask(h, "example.com.", "AAAA"))[:2] == (0, [])
    assert (await ask(h, "localhost.", "AAAA"))[:2] == (0, ["localhost. 3600 AAAA ::1"])
    assert (await ask(h, "1.0.0.10.in-addr.arpa.", "PTR"))[:2] == (0, ["1.0.0.10.in-addr.arpa. 3600 PTR example.org."])
    assert (await ask(h, "2.0.0.10.in-addr.arpa.", "PTR"))[:2] == (0, ["2.0.0.10.in-addr.arpa. 3600 PTR example.com."])
    assert (await ask(h, "1.0.0.127.in-addr.arpa.", "PTR"))[:2] == (
        0, ["1.0.0.127.in-addr.arpa. 3600 PTR localhost.", "1.0.0.127.in-addr.arpa. 3600 PTR localhost.domain."])
    ip6 = ".".join(reversed("0" * 31 + "1")) + ".ip6.arpa."
    assert (await ask(h, ip6, "PTR"))[:2] == (0, [f"{ip6} 3600 PTR localhost.", f"{ip6} 3600 PTR localhost.domain."])
    # the name exists with another type: NOERROR, no answer (NODATA), never passed on
    assert (await ask(h, "example.org.", "AAAA"))[:2] == (0, [])
    assert (await ask(h, "example.org.", "MX"))[:2] == (0, [])


async def test_answers_are_authoritative_and_keep_the_question(tmp_path):
    h = make("hosts hosts.txt", tmp_path, files={"hosts.txt": HOSTS_EXAMPLE})
    rcode, answers, reply = await ask(h, "Example.ORG.", "A")
    assert rcode == 0 and reply.header.aa == 1 and reply.header.qr == 1
    assert str(reply.q.qname) == "Example.ORG."          # the question as asked
    assert answers == ["example.org. 3600 A 10.0.0.1"]      # the answer lower-cased, as CoreDNS


GO_HOSTS = """255.255.255.255\tbroadcasthost
\t127.0.0.2\todin
\t127.0.0.3\todin  # inline comment
\t::2             odin
\t127.1.1.1\tthor
\t# aliases
\t127.1.1.2\tullr ullrhost
\tfe80::1%lo0\tlocalhost
\t# Bogus entries that must be ignored.
\t123.123.123\tloki
\t321.321.321.321
"""


def vals(table: hostsmod.Table, kind: str, key: str) -> list[str]:
    return hostsmod._values(table.get(kind, key))


def test_hostsfile_parse_as_go_reads_it():
    t = hostsmod.parse(GO_HOSTS, ["."])
    assert vals(t, "v4", "odin.") == ["127.0.0.2", "127.0.0.3"] and vals(t, "v6", "odin.") == ["::2"]
    assert vals(t, "v4", "ullr.") == ["127.1.1.2"] and vals(t, "v4", "ullrhost.") == ["127.1.1.2"]
    assert not vals(t, "v4", "localhost.") and vals(t, "v6", "localhost.") == ["fe80::1"]   # zone %lo0 dropped
    assert "loki." not in t.keys("v4") and t.skipped == 1                          # bad address skipped
    assert vals(t, "ptr", "127.1.1.2") == ["ullr.", "ullrhost."]
    assert vals(t, "ptr", "255.255.255.255") == ["broadcasthost."]
    assert vals(t, "ptr", "fe80::1") == ["localhost."]


def test_hostsfile_ipv4_and_ipv6_aliases_and_comments():
    v4 = hostsmod.parse("# c\n#\n\n127.0.0.1\tlocalhost\t# tab\n127.0.0.2\tlocalhost       # space\n"
                        "127.0.0.3\tlocalhost\tlocalhost.localdomain", ["."])
    assert vals(v4, "v4", "localhost.") == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert vals(v4, "v4", "localhost.localdomain.") == ["127.0.0.3"]
    assert vals(v4, "ptr", "127.0.0.3") == ["localhost.", "localhost.localdomain."]
    v6 = hostsmod.parse("::1\t\tlocalhost\nfe80:0000:0000:0000:0000:0000:0000:0001\tlocalhost\n"
                        "fe80:0000:0000:0000:0000:0000:0000:0002%lo0\tlocalhost\n"
                        "fe80::3%lo0\tlocalhost\tlocalhost.localdomain", ["."])
    assert vals(v6, "v6", "localhost.") == ["::1", "fe80::1", "fe80::2", "fe80::3"]
    assert vals(v6, "ptr", "fe80::3") == ["localhost.", "localhost.localdomain."]


async def test_names_match_in_any_letter_case(tmp_path):
    h = make("hosts hosts.txt", tmp_path,
             files={"hosts.txt": "127.0.0.1\tPreserveMe\tPreserveMe.local\n::1\t\tPreserveMe\tPreserveMe.local\n"})
    for name in ("PreserveMe.", "preserveme.", "PRESERVEME.", "PreserveMe.LOCAL."):
        rcode, answers, _ = await ask(h, name, "A")
        assert rcode == 0 and answers == [f"{name.lower()} 3600 A 127.0.0.1"], name
        rcode, answers, _ = await ask(h, name, "AAAA")
        assert answers == [f"{name.lower()} 3600 AAAA ::1"]
    # PTR targets are the lower-cased names (plugin.Name.Normalize)
    assert (await ask(h, "1.0.0.127.IN-ADDR.ARPA.", "PTR"))[1] == [
        "1.0.0.127.in-addr.arpa. 3600 PTR preserveme.", "1.0.0.127.in-addr.arpa. 3600 PTR preserveme.local."]


async def test_a_name_not_listed_is_servfail_without_fallthrough_and_next_with_it(tmp_path):
    files = {"h": "10.0.0.1 example.org\n"}
    h = make("hosts h", tmp_path, files=files)
    assert (await ask(h, "missing.example.org.", "A"))[0] == 2
    assert (await ask(h, "missing.example.org.", "TXT"))[0] == 2
    h = make("hosts h {\n fallthrough\n}", tmp_path, files=files)
    assert (await ask(h, "missing.example.org.", "A"))[0] == "next"
    assert (await ask(h, "example.org.", "A"))[1] == ["example.org. 3600 A 10.0.0.1"]
    # fallthrough limited to some zones: other names in the plugin's zones are SERVFAIL
    h = make("hosts h {\n fallthrough example.net\n}", tmp_path, files=files)
    assert (await ask(h, "a.example.net.", "A"))[0] == "next"
    assert (await ask(h, "a.example.com.", "A"))[0] == 2


async def test_names_outside_the_plugins_zones_go_on_whatever_fallthrough_says(tmp_path):
    files = {"h": "10.0.0.1 example.org other.net\n"}
    h = make("hosts h example.org", tmp_path, files=files)
    assert h.origins == ["example.org."]
    assert (await ask(h, "other.net.", "A"))[0] == "next"          # not loaded: outside the zones
    assert (await ask(h, "example.org.", "A"))[1] == ["example.org. 3600 A 10.0.0.1"]
    assert (await ask(h, "x.example.org.", "A"))[0] == 2
    # a PTR question is looked up wherever it is; with no names it goes on (no fallthrough needed)
    assert (await ask(h, "1.0.0.10.in-addr.arpa.", "PTR"))[1] == ["1.0.0.10.in-addr.arpa. 3600 PTR example.org."]
    assert (await ask(h, "9.0.0.10.in-addr.arpa.", "PTR"))[0] == "next"
    assert (await ask(h, "0.10.in-addr.arpa.", "PTR"))[0] == "next"          # not a whole address
    # the block's zones are the default
    h = make("hosts h", tmp_path, zones=["example.org.", "example.net."], files=files)
    assert h.origins == ["example.org.", "example.net."]
    assert (await ask(h, "other.net.", "A"))[0] == "next"


async def test_inline_entries_and_the_file_both_count_file_first(tmp_path):
    files = {"h": "10.0.0.1 example.org\n10.0.0.9 file.only\n"}
    h = make("hosts h {\n 10.0.0.2 example.org\n 10.0.0.1 Inline.Example\n fallthrough\n}", tmp_path, files=files)
    assert (await ask(h, "example.org.", "A"))[1] == ["example.org. 3600 A 10.0.0.1", "example.org. 3600 A 10.0.0.2"]
    assert (await ask(h, "inline.example.", "A"))[1] == ["inline.example. 3600 A 10.0.0.1"]
    assert (await ask(h, "file.only.", "A"))[1] == ["file.only. 3600 A 10.0.0.9"]
    assert (await ask(h, "1.0.0.10.in-addr.arpa.", "PTR"))[1] == [
        "1.0.0.10.in-addr.arpa. 3600 PTR example.org.", "1.0.0.10.in-addr.arpa. 3600 PTR inline.example."]


async def test_inline_only_with_a_missing_file_serves_inline_entries(tmp_path, caplog):
    # AKS's documented override: `hosts { 10.0.0.1 example1.org ... fallthrough }`
    h = make("hosts missing-file {\n 10.0.0.1 example1.org\n 10.0.0.2 example2.org\n"
             " 10.0.0.3 example3.org\n fallthrough\n}", tmp_path)
    assert "does not exist" in caplog.text
    assert (await ask(h, "example2.org.", "A"))[1] == ["example2.org. 3600 A 10.0.0.2"]
    assert (await ask(h, "example4.org.", "A"))[0] == "next"


async def test_default_file_is_etc_hosts(tmp_path):
    h = make("hosts", tmp_path)
    assert h.path == "/etc/hosts" and h.origins == ["."] and h.fall == []


async def test_ttl_and_no_reverse(tmp_path):
    files = {"h": "10.0.0.1 example.org\n"}
    h = make("hosts h {\n ttl 60\n no_reverse\n}", tmp_path, files=files)
    assert (await ask(h, "example.org.", "A"))[1] == ["example.org. 60 A 10.0.0.1"]
    assert (await ask(h, "1.0.0.10.in-addr.arpa.", "PTR"))[0] == "next"
    h = make("hosts h {\n ttl 65535\n}", tmp_path, files=files)
    assert (await ask(h, "1.0.0.10.in-addr.arpa.", "PTR"))[1] == ["1.0.0.10.in-addr.arpa. 65535 PTR example.org."]


async def test_unsupported_types_nodata_by_default_passed_on_with_fallthrough_unsupported(tmp_path):
    files = {"h": "10.0.0.1 example.org\n"}
    h = make("hosts h {\n fallthrough\n}", tmp_path, files=files)
    assert (await ask(h, "example.org.", "TXT"))[:2] == (0, [])
    assert (await ask(h, "example.org.", "HTTPS"))[:2] == (0, [])
    h = make("hosts h {\n fallthrough\n fallthrough_unsupported\n}", tmp_path, files=files)
    assert (await ask(h, "example.org.", "TXT"))[0] == "next"
    assert (await ask(h, "example.org.", "HTTPS"))[0] == "next"
    assert (await ask(h, "example.org.", "AAAA"))[:2] == (0, [])     # a supported type stays NODATA
    # in the fallthrough's zones only
    h = make("hosts h {\n fallthrough_unsupported\n fallthrough other.org\n}", tmp_path, files=files)
    assert (await ask(h, "example.org.", "TXT"))[:2] == (0, [])


async def test_wildcard_entries(tmp_path):
    h = make("hosts h example.com {\n 192.168.1.10 *.example.com\n 192.168.1.11 www.example.com\n"
             " fallthrough example.com\n}", tmp_path, files={"h": "192.168.1.12 b.example.com\n"})
    assert (await ask(h, "www.example.com.", "A"))[1] == ["www.example.com. 3600 A 192.168.1.11"]
    assert (await ask(h, "b.example.com.", "A"))[1] == ["b.example.com. 3600 A 192.168.1.12"]
    assert (await ask(h, "Apps.Example.com.", "A"))[1] == ["apps.example.com. 3600 A 192.168.1.10"]
    assert (await ask(h, "apps.example.com.", "AAAA"))[:2] == (0, [])
    assert (await ask(h, "example.com.", "A"))[0] == "next"               # the apex is not covered
    assert (await ask(h, "deep.apps.example.com.", "A"))[0] == "next"     # one label only
    # no PTR from a wildcard
    assert (await ask(h, "10.1.168.192.in-addr.arpa.", "PTR"))[0] == "next"
    assert (await ask(h, "11.1.168.192.in-addr.arpa.", "PTR"))[1] == [
        "11.1.168.192.in-addr.arpa. 3600 PTR www.example.com."]


def test_transparent_is_true_only_when_the_query_surely_goes_on(tmp_path):
    files = {"h": "10.0.0.1 example.org\n"}
    h = make("hosts h example.org {\n fallthrough\n}", tmp_path, files=files)
    assert h.transparent("web.default.svc.cluster.local.", 1)       # outside the zones
    assert h.transparent("missing.example.org.", 1)                  # not listed, falls through
    assert not h.transparent("example.org.", 1)
    assert not h.transparent("example.org.", 28)                     # NODATA is an answer
    assert not h.transparent("example.org.", 16)
    assert not h.transparent("1.0.0.10.in-addr.arpa.", 12)
    assert h.transparent("2.0.0.10.in-addr.arpa.", 12)
    h = make("hosts h example.org", tmp_path, files=files)
    assert not h.transparent("missing.example.org.", 1)              # SERVFAIL without fallthrough
    assert h.transparent("web.default.svc.cluster.local.", 1)
    h = make("hosts h {\n fallthrough\n fallthrough_unsupported\n}", tmp_path, files=files)
    assert h.transparent("example.org.", 16) and not h.transparent("example.org.", 1)


def test_describe_gives_the_effective_options(tmp_path):
    h = make("hosts h example.org {\n 10.0.0.2 a.example.org\n ttl 60\n reload 15s\n no_reverse\n"
             " fallthrough\n fallthrough_unsupported\n}", tmp_path, files={"h": "10.0.0.1 example.org\n"})
    text = h.describe()
    assert "\n" not in text
    assert text == (f"{tmp_path}/h example.org. entries=2 (inline 1) ttl=60 reload=15s no_reverse "
                    "fallthrough=. fallthrough_unsupported")
    assert make("hosts h {\n reload 0\n}", tmp_path).describe().endswith("ttl=3600 reload=off")


@pytest.mark.parametrize("text, message", [
    ("hosts h {\n ttl\n}", "Corefile:2: plugin/hosts: ttl needs a time in second"),
    ("hosts h {\n ttl sixty\n}", "Corefile:2: plugin/hosts: ttl needs a number of second"),
    ("hosts h {\n ttl 0\n}", "Corefile:2: plugin/hosts: ttl provided is invalid"),
    ("hosts h {\n ttl 65536\n}", "Corefile:2: plugin/hosts: ttl provided is invalid"),
    ("hosts h {\n ttl 5 6\n}", "Corefile:2: plugin/hosts: ttl takes one number of seconds"),
    ("hosts h {\n reload\n}", "Corefile:2: plugin/hosts: reload needs a duration (zero seconds to disable)"),
    ("hosts h {\n reload 5x\n}", "Corefile:2: plugin/hosts: invalid duration for reload '5x'"),
    ("hosts h {\n reload -1s\n}", "Corefile:2: plugin/hosts: invalid negative duration for reload '-1s'"),
    ("hosts h {\n no_reverse yes\n}", "Corefile:2: plugin/hosts: no_reverse takes no arguments"),
    ("hosts h {\n fallthrough_unsupported x\n fallthrough\n}",
     "Corefile:2: plugin/hosts: fallthrough_unsupported takes no arguments"),
    ("hosts h {\n fallthrough_unsupported\n}", "Corefile:1: plugin/hosts: fallthrough_unsupported needs fallthrough"),
    ("hosts h {\n fallthrough\n 10.0.0.1 example.org\n}", "Corefile:3: plugin/hosts: unknown property '10.0.0.1'"),
    ("hosts h {\n fallthrough\n ttl 5\n bogus\n}", "Corefile:4: plugin/hosts: unknown property 'bogus'"),
    ("hosts h {\n no-reverse\n}", "Corefile:2: plugin/hosts: unknown property 'no-reverse'"),
    ("hosts h {\n 10.0.0.1\n}", "Corefile:2: plugin/hosts: unknown property '10.0.0.1'"),
    ("hosts h {\n 10.0.0.256 a.example\n}", "Corefile:2: plugin/hosts: unknown property '10.0.0.256'"),
    ("hosts h {\n 10.0.0.1 " + "x" * 64 + ".example\n}", "Corefile:2: plugin/hosts: '" + "x" * 64),
    ("hosts h {\n ttl 5 {\n }\n}", "Corefile:2: plugin/hosts: ttl takes no block"),
])
def test_setup_errors_name_file_and_line(tmp_path, text, message):
    with pytest.raises(CorefileError) as err:
        make(text, tmp_path, files={"h": ""})
    assert str(err.value).startswith(message), str(err.value)


def test_a_hosts_file_that_cannot_be_read_is_a_setup_error(tmp_path):
    (tmp_path / "adir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name, why in (("adir", "Is a directory"), ("fifo", "not a regular file")):
        with pytest.raises(CorefileError) as err:
            make(f"hosts {name}", tmp_path)
        assert str(err.value) == f"Corefile:1: plugin/hosts: unable to access hosts file '{tmp_path}/{name}': {why}"
    with pytest.raises(CorefileError) as err:
        make("hosts /dev/zero", tmp_path)                 # would be read forever
    assert str(err.value).endswith("'/dev/zero': not a regular file")


def _touch(path, text: str) -> None:
    """Write `text` and move the mtime on, so even a same-size rewrite within one clock tick
    is seen as a change."""
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


async def test_reload_only_when_mtime_or_size_changed_and_keep_data_on_failure(tmp_path, monkeypatch, caplog):
    f = tmp_path / "h"
    h = make("hosts h {\n reload 0\n fallthrough\n}", tmp_path, files={"h": "10.0.0.1 a.example\n"})
    parses = []
    real_parse = hostsmod.parse
    monkeypatch.setattr(hostsmod, "parse", lambda *a, **k: parses.append(1) or real_parse(*a, **k))
    assert h.check() is False and parses == []                    # unchanged: not parsed again
    _touch(f, "10.0.0.2 a.example\n")
    assert h.check() is True and len(parses) == 1
    assert (await ask(h, "a.example.", "A"))[1] == ["a.example. 3600 A 10.0.0.2"]
    f.unlink()
    assert h.check() is False
    assert "keeping the last data" in caplog.text
    assert (await ask(h, "a.example.", "A"))[1] == ["a.example. 3600 A 10.0.0.2"]
    _touch(f, "10.0.0.3 b.example\n")
    assert h.check() is True
    assert (await ask(h, "a.example.", "A"))[0] == "next"
    assert (await ask(h, "b.example.", "A"))[1] == ["b.example. 3600 A 10.0.0.3"]


async def test_reload_loop_parses_in_a_worker_thread(tmp_path, monkeypatch):
    f = tmp_path / "h"
    h = make("hosts h {\n reload 20ms\n fallthrough\n}", tmp_path, files={"h": "10.0.0.1 a.example\n"})
    threads = []
    real_parse = hostsmod.parse
    monkeypatch.setattr(hostsmod, "parse",
                        lambda *a, **k: threads.append(threading.current_thread()) or real_parse(*a, **k))
    await h.start()
    try:
        _touch(f, "10.0.0.7 a.example\n")
        for _ in range(200):
            if (await ask(h, "a.example.", "A"))[1] == ["a.example. 3600 A 10.0.0.7"]:
                break
            await asyncio.sleep(0.01)
        assert (await ask(h, "a.example.", "A"))[1] == ["a.example. 3600 A 10.0.0.7"]
        assert threads and all(t is not threading.main_thread() for t in threads)
    finally:
        await h.stop()
    assert h._task is None


async def test_a_big_hosts_file_reloads_without_stalling_answers(tmp_path):
    lines = 100_000
    f = tmp_path / "h"
    body = "".join(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255} host{i}.example alias{i}.example\n"
                   for i in range(lines))
    assert len(body) > hostsmod.BIG
    h = make("hosts h {\n reload 0\n fallthrough\n}", tmp_path, files={"h": "10.9.9.9 fixed.example\n"})
    _touch(f, body)
    reload = asyncio.ensure_future(asyncio.to_thread(h.check))
    answered, worst, last = 0, 0.0, time.perf_counter()
    began = last
    while not reload.done():
        rcode, answers, _ = await ask(h, "other.name.", "A")
        assert rcode == "next"
        answered += 1
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
        await asyncio.sleep(0.001)
    assert await reload is True
    assert isinstance(h.data.file, hostsmod.PackedTable)      # parsed by a child process
    assert (await ask(h, f"host{lines - 1}.example.", "A"))[1] == [
        f"host{lines - 1}.example. 3600 A 10.1.134.159"]
    assert (await ask(h, "159.134.1.10.in-addr.arpa.", "PTR"))[1] == [
        f"159.134.1.10.in-addr.arpa. 3600 PTR host{lines - 1}.example.",
        f"159.134.1.10.in-addr.arpa. 3600 PTR alias{lines - 1}.example."]
    # queries kept being answered while the file was parsed (this process did not parse it)
    took = time.perf_counter() - began
    # (not a latency bound: on a loaded machine the loop waits for a CPU now and then)
    assert answered > 20, answered
    assert worst < max(0.1, took / 4), (worst, took)
    t0 = time.perf_counter()
    _touch(f, "10.0.0.1 small.example\n")
    assert h.check() is True                          # back to a small file: parsed here
    assert isinstance(h.data.file, hostsmod.Table) and time.perf_counter() - t0 < 1.0


def _same(a, b) -> None:
    """Two tables answer alike (a Table and its PackedTable)."""
    for kind in ("v4", "v6", "ptr"):
        keys = a.keys(kind)
        assert sorted(keys) == sorted(b.keys(kind)), kind
        for key in keys:
            assert a.get(kind, key) == b.get(kind, key), (kind, key)
            if kind != "ptr":
                assert a.has(key) and b.has(key)
    assert (len(a), a.skipped, a.wild, a.empty) == (len(b), b.skipped, b.wild, b.empty)


def test_a_packed_table_answers_as_the_table_it_packs():
    t = hostsmod.parse(GO_HOSTS + "".join(f"0.0.0.0 ad{i}.example\n" for i in range(300)) +
                       "10.0.0.1 *.w.example many.example\n::1 many.example\n", ["."])
    p = hostsmod.PackedTable(hostsmod.pack(t))
    _same(t, p)
    for missing in ("nope.", "odin.x.", "ü.example.", "", "."):
        assert not p.has(missing) and p.get("v4", missing) is None and p.get("ptr", missing) is None
    assert p.get("v4", "many.example.") == "10.0.0.1" and p.get("v6", "many.example.") == "::1"
    snap = hostsmod.Snapshot(p, hostsmod.parse("", ["."]))
    assert snap.owner("a.w.example.") == "*.w.example." and snap.owner("a.b.w.example.") is None
    assert snap.names("0.0.0.0") == [f"ad{i}.example." for i in range(300)]
    empty = hostsmod.parse("", ["."])
    _same(empty, hostsmod.PackedTable(hostsmod.pack(empty)))
    with pytest.raises(ValueError):
        hostsmod.PackedTable(b"XXXX" + bytes(60))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["10.0.0.1", "10.0.0.2", "::1", "::ffff:1.2.3.4", "0.0.0.0", " ", "\n", "#",
                                 "a.example", "b.example", "*.w.example", "A.EXAMPLE.", "x.y.z", "1.2.3"]),
                max_size=40))
def test_any_table_packs_alike(pieces):
    t = hostsmod.parse("".join(pieces), ["."])
    _same(t, hostsmod.PackedTable(hostsmod.pack(t)))


def test_a_big_file_parsed_apart_reads_what_setup_would(tmp_path, monkeypatch):
    text = GO_HOSTS + "10.1.2.3 only.example\n"
    monkeypatch.setattr(hostsmod, "BIG", 10)
    h = make("hosts h miek.nl example {\n no_reverse\n fallthrough\n}", tmp_path, files={"h": text})
    assert h.wait_loaded(30) and isinstance(h.data.file, hostsmod.PackedTable)
    _same(hostsmod.parse(text, ["miek.nl.", "example."], reverse=False), h.data.file)
    assert h.data.file.get("v4", "only.example.") == "10.1.2.3"


async def test_metrics_count_entries_and_the_last_reload(tmp_path):
    from clusterdns.metrics import DNS

    h = make("hosts h {\n 10.0.0.2 b.example\n reload 0\n}", tmp_path,
             files={"h": "10.0.0.1 a.example alias.example\n::1 a.example\n"})
    await h.start()
    try:
        # CoreDNS counts every address of every name and every reverse entry, file and inline
        assert DNS.get_sample_value("coredns_hosts_entries") == (2 + 1 + 3) + (1 + 1)   # file: A, AAAA, PTR; inline
        assert DNS.get_sample_value("coredns_hosts_reload_timestamp_seconds") == \
            os.stat(tmp_path / "h").st_mtime_ns / 1e9
    finally:
        await h.stop()
    assert DNS.get_sample_value("coredns_hosts_entries") is None


def test_zones_may_be_cidrs(tmp_path):
    # setup_test.go: `hosts /etc/hosts miek.nl 10.0.0.9/8` serves miek.nl. and 10.in-addr.arpa.
    h = make("hosts h miek.nl 10.0.0.9/8 {\n fallthrough 10.0.0.0/24\n}", tmp_path, files={"h": ""})
    assert h.origins == ["miek.nl.", "10.in-addr.arpa."]
    assert h.fall == ["0.0.10.in-addr.arpa."]


def test_many_values_for_one_key_keep_their_order():
    # ad-block lists: one address, thousands of names; and a name with many addresses
    text = "".join(f"0.0.0.0 ad{i}.example\n" for i in range(20)) + \
        "".join(f"10.0.0.{i} many.example\n" for i in range(1, 13))
    t = hostsmod.parse(text, ["."])
    assert vals(t, "ptr", "0.0.0.0") == [f"ad{i}.example." for i in range(20)]
    assert vals(t, "v4", "many.example.") == [f"10.0.0.{i}" for i in range(1, 13)]
    assert len(t) == 20 + 20 + 12 + 12


def test_binary_junk_in_a_hosts_file_is_skipped(tmp_path):
    (tmp_path / "h").write_bytes(b"1.2.3.4\x00 nul.example\n\xff\xfe 5.6.7.8\n::1\x00 x\n10.0.0.1 ok.example \xc3\xbc.example\n")
    h = make("hosts h", tmp_path)
    assert vals(h.data.file, "v4", "ok.example.") == ["10.0.0.1"]
    assert h.data.file.keys("v4") == ["ok.example."] and h.data.file.skipped == 4


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["10.0.0.1", "::1", "fe80::1%lo0", "::ffff:1.2.3.4", "1.2.3", "010.0.0.1", " ", "\t",
                                 "\n", "#", "a.example", "*.w.example", "A.EXAMPLE.", "..", "x" * 64, "\x00", "ü",
                                 "\r\n", "."]), max_size=30))
def test_any_hosts_text_parses(pieces):
    t = hostsmod.parse("".join(pieces), ["."])
    for kind in ("v4", "v6", "ptr"):
        for key in t.keys(kind):
            assert key and all(vals(t, kind, key))


async def test_a_file_missing_at_setup_is_read_when_it_appears(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="clusterdns.corefile.plugins.hosts")
    h = make("hosts later {\n 10.0.0.1 inline.example\n fallthrough\n}", tmp_path)
    assert h.check() is False
    assert caplog.text.count("later") == 1                 # the setup warning, not one per check
    _touch(tmp_path / "later", "10.0.0.2 file.example\n")
    assert h.check() is True and "readable again" in caplog.text
    assert (await ask(h, "file.example.", "A"))[1] == ["file.example. 3600 A 10.0.0.2"]
    assert (await ask(h, "inline.example.", "A"))[1] == ["inline.example. 3600 A 10.0.0.1"]


def test_an_unchanged_file_is_read_once_for_every_plugin_set_up_from_it(tmp_path, monkeypatch):
    # the reload plugin sets the whole Corefile up again every 30 s to compare digests
    reads = []
    real = hostsmod._read
    monkeypatch.setattr(hostsmod, "_read", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    text = "hosts h {\n reload 0\n fallthrough\n}"
    a = make(text, tmp_path, files={"h": "10.0.0.1 a.example\n"})
    b = make(text, tmp_path)
    assert len(reads) == 1 and b.data.file is a.data.file
    c = make("hosts h example {\n reload 0\n}", tmp_path)        # other zones: a table of its own
    assert len(reads) == 2 and c.data.file is not a.data.file
    _touch(tmp_path / "h", "10.0.0.2 a.example\n")
    d = make(text, tmp_path)
    assert len(reads) == 3 and vals(d.data.file, "v4", "a.example.") == ["10.0.0.2"]
    assert vals(a.data.file, "v4", "a.example.") == ["10.0.0.1"]    # until its own check
