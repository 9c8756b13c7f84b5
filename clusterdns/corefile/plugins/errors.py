"""CoreDNS's errors plugin: log the errors of the rest of the chain.

    errors [stdout] [{ consolidate DURATION REGEXP [LEVEL] [show_first]; stacktrace }]

As coredns/coredns plugin/errors: a plugin error passing through is logged
`[ERROR] plugin/errors: RCODE NAME TYPE: reason` (RCODE the number) and passed on. An error
whose reason matches a `consolidate` REGEXP (the first that matches) is counted instead; DURATION
after the first of them one line `N errors like 'REGEXP' occurred in last DURATION` is logged at
LEVEL (warning, error (the default), info, debug); `show_first` logs that first one at once too
(at LEVEL). On stop the pending counts are logged. `stacktrace` logs the traceback of an
unexpected exception (CoreDNS: of a recovered panic) before it goes on to the server.
"""
from __future__ import annotations

import asyncio
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any

import dnslib

from ..plugin import Next, Plugin, PluginError, Request, SetupContext
from ..syntax import Directive, plugin_error
from . import _coredns
from ._coredns import LEVELS, go_duration, go_duration_string, go_regexp, type_name


@dataclass
class Pattern:
    period: float
    regex: Any      # an RE2 regexp (Go's syntax)
    level: int = logging.ERROR
    show_first: bool = False
    count: int = 0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def summary(self) -> str:
        return (f"{self.count} errors like '{self.regex.pattern}' occurred in last "
                f"{go_duration_string(self.period)}")


class Errors(Plugin):
    name = "errors"

    def __init__(self, patterns: list[Pattern] | None = None, stacktrace: bool = False) -> None:
        self.patterns = patterns or []
        self.stacktrace = stacktrace
        self.stopped = False

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        try:
            return await next(req)
        except PluginError as exc:
            line = f"{exc.rcode} {req.qname} {type_name(req.qtype)}: {exc.reason or exc}"
            reason = exc.reason or str(exc)
            for p in self.patterns:
                if p.regex.search(reason):
                    if self._count(p, line):
                        raise
                    break
            _coredns.log(logging.ERROR, line, "errors")
            raise
        except Exception:
            if self.stacktrace:
                _coredns.log(logging.ERROR, f"{req.qname} {type_name(req.qtype)}: {traceback.format_exc()}",
                             "errors")
            raise

    def _count(self, p: Pattern, line: str) -> bool:
        """errorHandler.inc: False once stopped (the error is then logged as it is)."""
        if self.stopped:
            return False
        p.count += 1
        if p.count == 1:
            p.timer = asyncio.get_running_loop().call_later(p.period, self._flush, p)
            if p.show_first:
                _coredns.log(p.level, line, "errors")
        return True

    def _flush(self, p: Pattern) -> None:
        p.timer = None
        if p.count:
            _coredns.log(p.level, p.summary(), "errors")
        p.count = 0

    async def stop(self) -> None:
        self.stopped = True
        for p in self.patterns:
            if p.timer is not None:
                p.timer.cancel()
                self._flush(p)

    def transparent(self, qname: str, qtype: int) -> bool:
        return True   # the memo's answers are never errors

    def describe(self) -> str:
        parts = []
        for p in self.patterns:
            level = next(k for k, v in LEVELS.items() if v == p.level)
            first = " show_first" if p.show_first else ""
            parts.append(f"consolidate {go_duration_string(p.period)} {p.regex.pattern!r} {level}{first}")
        if self.stacktrace:
            parts.append("stacktrace")
        return "; ".join(parts) + (" (to stdout)" if parts else "to stdout")


def _consolidate(line: Directive) -> Pattern:
    args = line.values
    if not 2 <= len(args) <= 4:
        raise plugin_error(line, "consolidate takes DURATION REGEXP [LEVEL] [show_first]", "errors")
    try:
        period = go_duration(args[0])
    except ValueError as exc:
        raise plugin_error(line, str(exc), "errors") from None
    if period <= 0:
        raise plugin_error(line, f"consolidate: the DURATION must be positive, not {args[0]!r}", "errors")
    try:
        regex = go_regexp(args[1])
    except ValueError as exc:
        raise plugin_error(line, f"invalid REGEXP {args[1]!r}: {exc}", "errors") from None
    rest = args[2:]
    show_first = bool(rest) and rest[-1] == "show_first"
    if show_first:
        rest = rest[:-1]
    level = logging.ERROR
    if rest:
        if rest[0] not in LEVELS:
            raise plugin_error(line, f"unknown log level argument in consolidate: {rest[0]}", "errors")
        level = LEVELS[rest[0]]
        if len(rest) > 1:
            raise plugin_error(line, f"unexpected argument in consolidate: {rest[1]}", "errors")
    return Pattern(period, regex, level, show_first)


def setup(directive: Directive, ctx: SetupContext) -> Plugin:
    d, args = directive, directive.values
    if len(args) > 1:
        raise plugin_error(d, "takes at most one argument (stdout)")
    if args and args[0] != "stdout":
        raise plugin_error(d, f"invalid log file: {args[0]}")
    patterns: list[Pattern] = []
    stacktrace = False
    for line in d.lines():
        if line.name == "consolidate":
            patterns.append(_consolidate(line))
        elif line.name == "stacktrace":
            if line.args:
                raise plugin_error(line, "stacktrace takes no arguments", "errors")
            stacktrace = True
        else:
            raise plugin_error(line, f"unknown property '{line.name}'", "errors")
    return Errors(patterns, stacktrace)
