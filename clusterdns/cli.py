"""`clusterdns COMMAND [options]`: parse, validate, dispatch.

Each command lives in clusterdns/commands/<command>.py as `run(cfg) -> int`.
Bad flags and unreadable input exit with code 2 and a one-line reason.
"""
from __future__ import annotations

import importlib
import logging
import sys

from .config import load
from .errors import ConfigError, InputError, UsageError

__all__ = ["UsageError", "main"]


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load(argv)
    except ConfigError as exc:
        print(f"clusterdns: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    module = importlib.import_module(f"clusterdns.commands.{cfg.command}")
    try:
        return int(module.run(cfg) or 0)
    except InputError as exc:
        print(f"clusterdns: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
