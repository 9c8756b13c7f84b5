"""`clusterdns trace NAME`: follow a name from a pod's resolver to the Pods (see clusterdns/trace.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import sys

from ..config import Config
from ..errors import UsageError
from ..sources.loader import load_once
from ..trace import TraceError, build_trace, format_text


class _Held(logging.Handler):
    """Holds log records while the trace runs, so none lands in the middle of its output."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run(cfg: Config) -> int:
    state = load_once(cfg)
    root = logging.getLogger()
    held, others = _Held(), root.handlers[:]
    held.setFormatter(others[0].formatter if others else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.handlers = [held]
    try:
        data = asyncio.run(build_trace(cfg, state))
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    finally:
        root.handlers = others
    data["log"] = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in held.records]
    if cfg.run.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_text(data, color=sys.stdout.isatty()))
    sys.stdout.flush()
    for record in held.records:      # after the trace, on stderr, where log lines belong
        print(held.format(record), file=sys.stderr)
    return 0 if data["walk"]["outcome"] == "answer" else 1
