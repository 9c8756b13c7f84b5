"""`clusterdns trace NAME`: follow a name from a pod's resolver to the Pods (see clusterdns/trace.py)."""
from __future__ import annotations

import asyncio
import json
import sys

from ..cli import UsageError
from ..config import Config
from ..sources.loader import load_once
from ..trace import TraceError, build_trace, format_text


def run(cfg: Config) -> int:
    state = load_once(cfg)
    try:
        data = asyncio.run(build_trace(cfg, state))
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    if cfg.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_text(data, color=sys.stdout.isatty()))
    return 0 if data["walk"]["outcome"] == "answer" else 1
