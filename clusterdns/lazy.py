"""Modules imported when first used, for imports only some commands need."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _Lazy:
    """Stands for a module; the first attribute read imports it."""

    __slots__ = ("_name", "_mod")

    def __init__(self, name: str) -> None:
        self._name = name
        self._mod: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        mod = self._mod
        if mod is None:
            mod = self._mod = importlib.import_module(self._name)
        return getattr(mod, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def module(name: str) -> Any:
    return _Lazy(name)
