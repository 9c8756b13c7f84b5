"""Small network helpers shared by tests."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (for servers started as subprocesses)."""
    for _ in range(50):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("127.0.0.1", 0))
        port = u.getsockname()[1]
        t = socket.socket()
        try:
            t.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            u.close()
            t.close()
    raise RuntimeError("no free port")
