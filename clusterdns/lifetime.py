"""Object lifetime at scale: pausing the cyclic collector while building, and keeping
what a one-shot process built until its exit instead of freeing it object by object."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Iterator

# Set to a list by the process entry of a one-shot command (cli.entry), which exits
# without teardown; None otherwise, so long-running processes and tests free as usual.
RETAINED: list[Any] | None = None


def retain(obj: Any) -> None:
    """Keep obj until the process exits, when the process will exit without teardown
    (freeing a 10,000-Service state or rule set object by object costs ~0.1 s each)."""
    if RETAINED is not None:
        RETAINED.append(obj)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector while building many small acyclic objects: with a large
    state in memory its passes cost as much as the building and free nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
