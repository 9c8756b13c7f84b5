"""`clusterdns config check`: validate a configuration and print what it makes effective.

With --corefile: each server block's zones, the listeners it is bound to and its
plugins in the order they run (CoreDNS's plugin order, not the file's), then the
process-wide settings (health, ready, metrics, lameduck, reload). Errors exit 2
with FILE:LINE.
"""
from __future__ import annotations

import os

from ..config import Config
from ..errors import UsageError


def run(cfg: Config) -> int:
    if not cfg.dns.corefile:
        raise UsageError("config check: nothing to check (give --corefile FILE)")
    from ..corefile.build import prepare
    cf, _effective = prepare(cfg, os.environ.get("KUBE_DNS_SERVICE_HOST"))
    print(cf.describe())
    return 0
