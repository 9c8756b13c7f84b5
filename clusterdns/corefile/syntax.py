"""What a Corefile is made of once read: server blocks of directives, each token with
the file and line it came from (so every setup error can say FILE:LINE).

    ServerBlock(keys=[Token('.:53')], directives=[Directive('errors', ...), ...])
    Directive('forward', args=[Token('.'), Token('/etc/resolv.conf')],
              body=[Directive('max_concurrent', args=[Token('1000')])])

A directive's `body` holds the lines of its `{ ... }` block, each line read as a
directive of its own (its first token the name), nested as deep as the braces go;
`body` is None when the directive has no block and [] for an empty one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InputError


class CorefileError(InputError):
    """A Corefile that cannot be used: the message starts with FILE:LINE."""

    def __init__(self, where: "Token | Directive | str", message: str) -> None:
        place = where if isinstance(where, str) else where.where
        super().__init__(f"{place}: {message}" if place else message)
        self.where = place
        self.reason = message


@dataclass(frozen=True)
class Token:
    text: str
    file: str = ""
    line: int = 0
    quoted: bool = False

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else ""

    def __str__(self) -> str:
        return self.text


@dataclass
class Directive:
    name: str
    args: list[Token] = field(default_factory=list)
    body: list["Directive"] | None = None
    file: str = ""
    line: int = 0

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else ""

    @property
    def values(self) -> list[str]:
        return [t.text for t in self.args]

    def error(self, message: str) -> CorefileError:
        return CorefileError(self, message)

    def lines(self) -> list["Directive"]:
        """The lines of its block ([] without one)."""
        return self.body or []


@dataclass
class ServerBlock:
    keys: list[Token]
    directives: list[Directive]
    file: str = ""
    line: int = 0

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else ""


def plugin_error(d: Directive, message: str, plugin: str | None = None) -> CorefileError:
    """A setup error as CoreDNS words it: `FILE:LINE: plugin/NAME: message`."""
    return CorefileError(d, f"plugin/{plugin or d.name}: {message}")


def duration(text: str) -> float:
    """A Go duration (`5s`, `1m30s`, `250ms`, `1h`) or a bare number of seconds; ValueError otherwise."""
    s = text.strip()
    if not s:
        raise ValueError("empty duration")
    try:
        return float(int(s))
    except ValueError:
        pass
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    total, i, neg = 0.0, 0, False
    if s[0] in "+-":
        neg, i = s[0] == "-", 1
    if i >= len(s):
        raise ValueError(f"invalid duration {text!r}")
    while i < len(s):
        j = i
        while j < len(s) and (s[j].isdigit() or s[j] == "."):
            j += 1
        if j == i:
            raise ValueError(f"invalid duration {text!r}")
        number = float(s[i:j])
        k = j
        while k < len(s) and not (s[k].isdigit() or s[k] == "."):
            k += 1
        unit = s[j:k]
        if unit not in units:
            raise ValueError(f"invalid duration {text!r}")
        total += number * units[unit]
        i = k
    return -total if neg else total
