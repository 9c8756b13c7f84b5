"""Helpers shared by the small setup-time plugins."""
from __future__ import annotations

from ..syntax import Directive, duration, plugin_error


def no_block(d: Directive) -> None:
    """Refuse a `{ ... }` block on a plugin that takes none (naming its first line)."""
    if d.body:
        raise plugin_error(d.body[0], f"unknown property '{d.body[0].name}'", d.name)


def address(d: Directive, text: str) -> str:
    """A listen address as CoreDNS takes it (`:8080`, `host:port`, `[v6]:port`), checked."""
    from ...config import parse_hostport
    from ...errors import ConfigError
    try:
        host, port = parse_hostport(text, 0)
    except ConfigError as exc:
        raise plugin_error(d, f"{text}: {exc}") from None
    if port == 0:
        raise plugin_error(d, f"{text}: a port is needed")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def seconds(d: Directive, text: str, what: str) -> float:
    try:
        return duration(text)
    except ValueError:
        raise plugin_error(d, f"{what}: invalid duration {text!r}") from None
