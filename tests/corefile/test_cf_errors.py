"""errors (clusterdns/corefile/plugins/errors.py), pinned to coredns/coredns plugin/errors:
README.md, errors_test.go (TestErrors' line, TestLogPattern's levels and summary, TestInc,
TestStop), setup.go/setup_test.go (consolidate's arguments and levels)."""
from __future__ import annotations

import asyncio

import dns.rcode
import pytest

from clusterdns.corefile.plugin import SERVFAIL, PluginError
from clusterdns.corefile.plugins import errors
from clusterdns.corefile.plugins._coredns import go_duration_string
from clusterdns.corefile.syntax import CorefileError
from tests.corefile.cfplugkit import Canned, Upstream, ctx, directive, query, real_directives
from tests.corefile.cfserve import CorefileServer

NOTAUTH = 9


def plug(text: str) -> errors.Errors:
    p = errors.setup(directive(text), ctx())
    assert isinstance(p, errors.Errors)
    return p


def out(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert captured.err == ""
    # the stamp off each line (a traceback's further lines have none)
    return [line.split("Z ", 1)[1] if line[:1].isdigit() else line for line in captured.out.splitlines() if line]


async def fail(p: errors.Errors, reason: str, rcode: int = SERVFAIL, name: str = "example.org.") -> None:
    err = PluginError(rcode, reason)
    with pytest.raises(PluginError) as info:
        await p.serve(query(name), Canned(error=err))
    assert info.value is err          # passed on as it came


async def test_success_is_not_logged_and_errors_are(capsys):
    # TestErrors
    p = plug("errors")
    reply = await p.serve(query("example.org."), Canned(answer="@ 5 IN A 10.0.0.1"))
    assert reply.rr and out(capsys) == []
    await fail(p, "test error", NOTAUTH)
    await fail(p, "read udp 10.0.0.1:53: i/o timeout", SERVFAIL, "Web.Example.ORG.")
    assert out(capsys) == ["[ERROR] plugin/errors: 9 example.org. A: test error",
                           "[ERROR] plugin/errors: 2 web.example.org. A: read udp 10.0.0.1:53: i/o timeout"]


@pytest.mark.parametrize("level, tag", [("", "ERROR"), ("error", "ERROR"), ("warning", "WARNING"),
                                        ("info", "INFO")])
async def test_consolidate_prints_one_summary_at_its_level(capsys, level, tag):
    # TestLogPattern / TestInc
    p = plug(f'errors {{\n  consolidate 100ms "^error.*!$" {level}\n}}')
    for _ in range(4):
        await fail(p, "error happened!")
    assert out(capsys) == []
    await asyncio.sleep(0.25)
    assert out(capsys) == [f"[{tag}] plugin/errors: 4 errors like '^error.*!$' occurred in last 100ms"]
    # a new window starts with the next error
    await fail(p, "error again!")
    await asyncio.sleep(0.25)
    assert out(capsys) == [f"[{tag}] plugin/errors: 1 errors like '^error.*!$' occurred in last 100ms"]


async def test_debug_level_is_not_printed_without_a_debug_plugin(capsys):
    p = plug('errors {\n  consolidate 50ms "x" debug\n}')
    await fail(p, "x")
    await asyncio.sleep(0.15)
    assert out(capsys) == []


async def test_show_first_logs_the_first_at_once(capsys):
    p = plug('errors {\n  consolidate 100ms ".* i/o timeout$" warning show_first\n}')
    await fail(p, "read udp: i/o timeout")
    assert out(capsys) == ["[WARNING] plugin/errors: 2 example.org. A: read udp: i/o timeout"]
    await fail(p, "read udp: i/o timeout")
    await fail(p, "read udp: i/o timeout")
    assert out(capsys) == []
    await asyncio.sleep(0.25)
    assert out(capsys) == ["[WARNING] plugin/errors: 3 errors like '.* i/o timeout$' occurred in last 100ms"]


async def test_first_matching_pattern_wins_and_the_rest_are_logged(capsys):
    p = plug('errors {\n  consolidate 100ms "timeout"\n  consolidate 100ms ".*" warning\n}')
    await fail(p, "i/o timeout")
    await fail(p, "i/o timeout")
    await fail(p, "connection refused")
    await asyncio.sleep(0.25)
    assert sorted(out(capsys)) == sorted(["[ERROR] plugin/errors: 2 errors like 'timeout' occurred in last 100ms",
                                          "[WARNING] plugin/errors: 1 errors like '.*' occurred in last 100ms"])
    p = plug('errors {\n  consolidate 1s "^timeout"\n}')
    await fail(p, "no match here")
    assert out(capsys) == ["[ERROR] plugin/errors: 2 example.org. A: no match here"]


async def test_stop_prints_the_pending_counts_then_logs_each_error(capsys):
    # TestStop
    p = plug('errors {\n  consolidate 2s "^error.*!$"\n}')
    for _ in range(3):
        await fail(p, "error x!")
    await p.stop()
    assert out(capsys) == ["[ERROR] plugin/errors: 3 errors like '^error.*!$' occurred in last 2s"]
    await fail(p, "error y!")
    assert out(capsys) == ["[ERROR] plugin/errors: 2 example.org. A: error y!"]


async def test_stacktrace_logs_an_unexpected_exception(capsys):
    async def broken(req):
        raise RuntimeError("kaboom")
    p = plug("errors {\n  stacktrace\n}")
    with pytest.raises(RuntimeError):
        await p.serve(query("example.org."), broken)
    text = "\n".join(out(capsys))
    assert text.startswith("[ERROR] plugin/errors: example.org. A: Traceback (most recent call last):")
    assert "RuntimeError: kaboom" in text
    with pytest.raises(RuntimeError):
        await plug("errors").serve(query("example.org."), broken)
    assert out(capsys) == []


def test_go_duration_strings():
    assert [go_duration_string(s) for s in (300, 30, 3600, 1.5, 0.1, 90, 0.0015, 0)] == \
        ["5m0s", "30s", "1h0m0s", "1.5s", "100ms", "1m30s", "1.5ms", "0s"]


def test_transparent_and_describe():
    p = plug('errors stdout {\n  consolidate 5m ".* i/o timeout$" warning\n  stacktrace\n}')
    assert p.transparent("web.default.svc.cluster.local.", 1)
    assert p.describe() == "consolidate 5m0s '.* i/o timeout$' warning; stacktrace (to stdout)"
    assert plug("errors {\n}").describe() == "to stdout"


@pytest.mark.parametrize("text, line, message", [
    ("errors a b", 1, "takes at most one argument"),
    ("errors /var/log/errors", 1, "invalid log file: /var/log/errors"),
    ('errors {\n  consolidate 5m\n}', 2, "consolidate takes DURATION REGEXP [LEVEL] [show_first]"),
    ('errors {\n  consolidate 5m x warning show_first more\n}', 2, "consolidate takes DURATION REGEXP"),
    ('errors {\n  consolidate 5 x\n}', 2, "missing unit in duration"),
    ('errors {\n  consolidate soon x\n}', 2, "invalid duration"),
    ('errors {\n  consolidate 0s x\n}', 2, "must be positive"),
    ('errors {\n  consolidate 5m "(x"\n}', 2, "invalid REGEXP '(x': error parsing regexp: missing )"),
    ('errors {\n  consolidate 5m "(?=x)"\n}', 2, "invalid REGEXP '(?=x)'"),
    ('errors {\n  consolidate 5m x warn\n}', 2, "unknown log level argument in consolidate: warn"),
    ('errors {\n  consolidate 5m x WARNING\n}', 2, "unknown log level argument in consolidate: WARNING"),
    ('errors {\n  consolidate 5m x show_first warning\n}', 2, "unknown log level argument in consolidate: show_first"),
    ('errors {\n  stacktrace now\n}', 2, "stacktrace takes no arguments"),
    ('errors {\n  panicRecoveryStacktrace\n}', 2, "unknown property 'panicRecoveryStacktrace'"),
])
def test_setup_refuses_with_file_line(text, line, message):
    with pytest.raises(CorefileError) as info:
        errors.setup(directive(text), ctx())
    err = str(info.value)
    assert err.startswith(f"Corefile:{line}: plugin/errors: "), err
    assert message in err, err


def test_setup_accepts():
    assert plug("errors").patterns == []
    assert plug("errors stdout").patterns == []
    p = plug('errors {\n  consolidate 5m ".* i/o timeout$" warning\n  consolidate 30s "^Failed to .+"\n}')
    assert [(x.period, x.regex.pattern, x.level, x.show_first) for x in p.patterns] == [
        (300.0, ".* i/o timeout$", 30, False), (30.0, "^Failed to .+", 40, False)]
    p = plug('errors {\n  consolidate 1m30s x show_first\n}')
    assert (p.patterns[0].period, p.patterns[0].level, p.patterns[0].show_first) == (90.0, 40, True)


@pytest.mark.parametrize("where, d", real_directives("errors"), ids=lambda v: v if isinstance(v, str) else "")
def test_real_corefiles_lines_are_accepted(where, d):
    assert errors.setup(d, ctx()).describe()


async def test_socket_errors_and_log_lines_for_a_dead_upstream(tmp_path, capsys):
    async with Upstream() as gone:
        port = gone.port          # nothing listens there once it is stopped
    text = (".:{PORT} {\n  bind 127.0.0.1\n  errors\n  log . {\n    class error\n  }\n"
            f"  forward . 127.0.0.1:{port}\n}}\n")
    async with CorefileServer(text, tmp_path) as s:
        r = await s.ask("x.example.org", "A", timeout=10)
        assert r.rcode() == dns.rcode.SERVFAIL
    got = out(capsys)
    assert any(x.startswith("[ERROR] plugin/errors: 2 x.example.org. A: plugin/forward: ") for x in got), got
    assert any('"A IN x.example.org. udp ' in x and " SERVFAIL qr,rd " in x for x in got), got


async def test_consolidate_matches_non_ascii_reasons(capsys):
    p = plug('errors {\n  consolidate 50ms "^échec (.*)$"\n}')
    await fail(p, "échec de la résolution")
    await fail(p, "ascii only")
    await asyncio.sleep(0.15)
    assert sorted(out(capsys)) == ["[ERROR] plugin/errors: 1 errors like '^échec (.*)$' occurred in last 50ms",
                                   "[ERROR] plugin/errors: 2 example.org. A: ascii only"]
