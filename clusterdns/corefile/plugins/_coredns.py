"""CoreDNS's spellings, shared by the log, errors and rewrite plugins.

Log lines go to standard output as CoreDNS writes them (`2026-01-02T03:04:05.678Z [INFO] ...`,
plugin messages as `[ERROR] plugin/errors: ...`), through the `clusterdns.coredns` logger. As in
CoreDNS, INFO and above always print (a Corefile's `log` asked for them, whatever clusterdns's
own --log-level) and DEBUG never (CoreDNS prints it only under its `debug` plugin, which
clusterdns does not have); they do not propagate to clusterdns's stderr handler.
Type, class and rcode names are miekg/dns's String() forms; durations are Go's.
"""
from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import dnslib
import re2

from ..syntax import duration as _duration

LOGGER = logging.getLogger("clusterdns.coredns")
_LEVEL = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR"}


class _Stdout(logging.Handler):
    """Writes to whatever sys.stdout is at the time (pytest's capsys swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must not fail the query
            self.handleError(record)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        level = _LEVEL.get(record.levelno, record.levelname)
        return f"{stamp}.{int(record.msecs):03d}Z [{level}] {record.getMessage()}"


if not any(isinstance(h, _Stdout) for h in LOGGER.handlers):
    _handler = _Stdout()
    _handler.setFormatter(_Format())
    LOGGER.addHandler(_handler)
    LOGGER.propagate = False
    LOGGER.setLevel(logging.INFO)

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def log(level: int, message: str, plugin: str = "") -> None:
    """One CoreDNS log line; `plugin` adds the `plugin/NAME: ` prefix (clog.NewWithPlugin)."""
    if LOGGER.isEnabledFor(level):
        LOGGER.log(level, "%s", f"plugin/{plugin}: {message}" if plugin else message)


_CLASSES = {1: "IN", 2: "CS", 3: "CH", 4: "HS", 254: "NONE", 255: "ANY"}
CLASS_BY_NAME = {v: k for k, v in _CLASSES.items()}
_RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED",
           6: "YXDOMAIN", 7: "YXRRSET", 8: "NXRRSET", 9: "NOTAUTH", 10: "NOTZONE", 16: "BADSIG",
           17: "BADKEY", 18: "BADTIME", 19: "BADMODE", 20: "BADNAME", 21: "BADALG", 22: "BADTRUNC",
           23: "BADCOOKIE"}
RCODE_BY_NAME = {v: k for k, v in _RCODES.items()} | {"NOTIMPL": 4, "BADVERS": 16}


def type_name(qtype: int) -> str:
    name = dnslib.QTYPE.forward.get(qtype)
    return name if isinstance(name, str) else f"TYPE{qtype}"


def type_by_name(text: str) -> int | None:
    value = dnslib.QTYPE.reverse.get(text.upper())
    return value if isinstance(value, int) else None


def class_name(qclass: int) -> str:
    return _CLASSES.get(qclass, f"CLASS{qclass}")


def rcode_name(rcode: int) -> str:
    return _RCODES.get(rcode, str(rcode))


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False    # a bad pattern is reported once, as a setup error


try:
    _UNANCHORED = re2._re2.RE2.Anchor.UNANCHORED
except AttributeError:      # another google-re2 layout: its search() alone
    _UNANCHORED = None


class Found:
    """A match: group(i) ('' for a group that took no part, as Go's FindStringSubmatch) and groups()."""
    __slots__ = ("text", "spans")

    def __init__(self, text: str, spans: list[tuple[int, int]]) -> None:
        self.text, self.spans = text, spans

    def group(self, i: int = 0) -> str:
        start, end = self.spans[i]
        return "" if start < 0 else self.text[start:end]

    def groups(self) -> tuple[str, ...]:
        return tuple(self.group(i) for i in range(1, len(self.spans)))


class GoRegexp:
    """An RE2 regexp, searched through RE2's own Match for ASCII text (DNS names as dnslib spells
    them): the re2 module's search() builds a re-like match object at ~4 times the cost."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.pattern: str = compiled.pattern
        self.groups: int = compiled.groups
        self._raw = getattr(compiled, "_regexp", None) if _UNANCHORED is not None else None

    def search(self, text: str) -> Found | None:
        if self._raw is not None and text.isascii():
            data = text.encode()
            spans = self._raw.Match(_UNANCHORED, data, 0, len(data))
            return None if spans[0][0] < 0 else Found(text, spans)
        m = self.compiled.search(text)
        return None if m is None else Found(text, [m.span(i) for i in range(self.groups + 1)])


def go_regexp(pattern: str) -> GoRegexp:
    """regexp.Compile: RE2 (Go's syntax and errors, linear-time matching); ValueError with its reason."""
    try:
        return GoRegexp(re2.compile(pattern, _RE2_OPTIONS))
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"error parsing regexp: {reason}") from None


_GO_DURATION = re.compile(r"[+-]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+")


def go_duration(text: str) -> float:
    """time.ParseDuration: units are required (only `0` may go without); ValueError otherwise."""
    if text != "0" and not _GO_DURATION.fullmatch(text):
        raise ValueError(f"time: invalid duration {text!r}" if not text.isdigit()
                         else f"time: missing unit in duration {text!r}")
    return _duration(text)


def go_duration_string(seconds: float) -> str:
    """time.Duration.String(): `2s`, `5m0s`, `1h0m0s`, `1.5s`, `100ms`, `0s`."""
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    if ns < 1_000_000_000:
        for unit, size in (("ms", 1_000_000), ("µs", 1_000), ("ns", 1)):
            if ns >= size or unit == "ns":
                return sign + _frac(ns, size) + unit
    h, rest = divmod(ns, 3_600_000_000_000)
    m, rest = divmod(rest, 60_000_000_000)
    out = f"{h}h{m}m" if h else (f"{m}m" if m else "")
    return sign + out + _frac(rest, 1_000_000_000) + "s"


def _frac(value: int, size: int) -> str:
    whole, part = divmod(value, size)
    if not part:
        return str(whole)
    digits = len(str(size)) - 1
    return f"{whole}." + f"{part:0{digits}d}".rstrip("0")
