"""resolv.conf: parsing, and the names a stub resolver tries for a query.

Used twice: the forwarder takes its default upstreams from the node's
resolv.conf, and `trace` replays a pod's search-list walk (glibc order).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# glibc's limits (resolv/resolv.h): ndots is capped at 15, timeout at 30 s,
# attempts at 5. Values above are clamped, as glibc does, not rejected.
MAX_NDOTS = 15
MAX_TIMEOUT = 30
MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class ResolvConf:
    nameservers: tuple[str, ...] = ()
    search: tuple[str, ...] = ()
    ndots: int = 1
    timeout: int = 5
    attempts: int = 2
    rotate: bool = False
    options: tuple[str, ...] = ()          # every option as written, known or not
    warnings: tuple[str, ...] = field(default=(), compare=False)


def _int_option(value: str, low: int, high: int) -> int | None:
    try:
        n = int(value)
    except ValueError:
        return None
    return max(low, min(high, n))


def parse(text: str) -> ResolvConf:
    """Parse resolv.conf text the way glibc reads it.

    `search` and `domain` override each other (the last one wins); comments
    start with `#` or `;`; unknown keywords and malformed options are kept as
    warnings, never errors, because a stub resolver ignores them too.
    """
    nameservers: list[str] = []
    search: list[str] = []
    ndots, timeout, attempts, rotate = 1, 5, 2, False
    options: list[str] = []
    warnings: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        key, args = words[0], words[1:]
        if key == "nameserver":
            if args:
                nameservers.append(args[0])
            else:
                warnings.append(f"line {lineno}: nameserver without an address")
        elif key == "search":
            search = [d.rstrip(".") for d in args if d.rstrip(".")]
        elif key == "domain":
            search = [args[0].rstrip(".")] if args and args[0].rstrip(".") else []
        elif key == "options":
            for opt in args:
                options.append(opt)
                name, _, value = opt.partition(":")
                if name == "ndots":
                    n = _int_option(value, 0, MAX_NDOTS)
                    ndots = ndots if n is None else n
                elif name == "timeout":
                    n = _int_option(value, 1, MAX_TIMEOUT)
                    timeout = timeout if n is None else n
                elif name == "attempts":
                    n = _int_option(value, 1, MAX_ATTEMPTS)
                    attempts = attempts if n is None else n
                elif name == "rotate":
                    rotate = True
                else:
                    continue
                if name != "rotate" and n is None:
                    warnings.append(f"line {lineno}: bad option {opt!r}")
        else:
            warnings.append(f"line {lineno}: unknown keyword {key!r}")
    return ResolvConf(tuple(nameservers), tuple(search), ndots, timeout, attempts, rotate,
                      tuple(options), tuple(warnings))


def read(path: str) -> ResolvConf:
    """Parse a resolv.conf file; a missing or unreadable file raises OSError."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        return parse(fh.read())


def candidates(name: str, conf: ResolvConf) -> list[str]:
    """The fully qualified names (with a trailing dot) a glibc stub tries, in order.

    A trailing dot makes the name absolute: only it is tried. Otherwise a name
    with at least `ndots` dots is tried as written first and then with each
    search domain; a name with fewer dots goes through the search list first
    and is tried as written last (glibc res_search).
    """
    name = name.strip()
    if not name or name == ".":
        return ["."]
    if name.endswith("."):
        return [name]
    dots = name.count(".")
    as_is = name + "."
    searched = [f"{name}.{domain}." for domain in conf.search]
    if dots >= conf.ndots:
        return _unique([as_is] + searched)
    return _unique(searched + [as_is])


def _unique(names: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for n in names:
        if n.lower() not in seen:
            seen.add(n.lower())
            out.append(n)
    return out


__all__ = ["ResolvConf", "candidates", "parse", "read"]
