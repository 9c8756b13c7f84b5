"""Which plugins exist, the fixed order they run in, and which may appear only once.

ORDER is the slice of CoreDNS's plugin.cfg that matters here, first to last: a
server block runs its plugins in this order whatever order the Corefile wrote
them in. KNOWN_ELSEWHERE are CoreDNS plugins clusterdns does not have: naming
one is a setup error that says so (rather than "unknown directive").
"""
from __future__ import annotations

import importlib

from .plugin import Setup

ORDER = ("reload", "nsid", "bufsize", "bind", "debug", "trace", "ready", "health", "pprof", "shed",
         "prometheus", "errors", "log", "dnstap", "local", "dns64", "any", "chaos", "loadbalance",
         "tsig", "rewrite", "autopath", "acl", "cache", "header", "dnssec", "tls", "minimal",
         "template", "transfer", "hosts", "route53", "azure", "clouddns", "k8s_external",
         "kubernetes", "file", "auto", "secondary", "etcd", "loop", "forward", "grpc", "erratic",
         "whoami", "on", "sign", "view")

# The plugins clusterdns has: name -> module under clusterdns.corefile.plugins exporting setup().
SUPPORTED = {
    "reload": "reload", "bind": "bind", "ready": "ready", "health": "health",
    "prometheus": "prometheus", "errors": "errors", "log": "log", "loadbalance": "loadbalance",
    "rewrite": "rewrite", "autopath": "autopath", "cache": "cache", "template": "template",
    "hosts": "hosts", "kubernetes": "kubernetes", "loop": "loop", "forward": "forward",
    "whoami": "whoami", "nsid": "nsid",
}

# CoreDNS setup returns plugin.ErrOnce for a second one in a block.
ONCE = {"cache", "errors", "hosts", "kubernetes", "loop", "prometheus", "ready", "health",
        "reload", "autopath", "loadbalance", "nsid", "bufsize"}

KNOWN_ELSEWHERE = set(ORDER) - set(SUPPORTED) | {"federation", "import"}


def rank(name: str) -> int:
    return ORDER.index(name)


def available(name: str) -> bool:
    """Is the plugin's module here (plugins land one by one)?"""
    import importlib.util
    return name in SUPPORTED and importlib.util.find_spec(f"clusterdns.corefile.plugins.{SUPPORTED[name]}") is not None


def setup_for(name: str) -> Setup:
    module = importlib.import_module(f"clusterdns.corefile.plugins.{SUPPORTED[name]}")
    return module.setup   # type: ignore[no-any-return]
