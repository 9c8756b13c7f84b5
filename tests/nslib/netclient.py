"""Client for the namespace tests: many connections, one JSON summary on stdout.

Usage: netclient.py tcp|udp|http HOST PORT COUNT [--bind SRC] [--sport N] [--timeout S] [--path P]
Each answer is [name, peer address as the backend saw it]; errors are counted
by kind (refused: RST or ICMP port unreachable; timeout: dropped).
"""
import argparse
import json
import socket
import time
import urllib.request

p = argparse.ArgumentParser()
p.add_argument("proto")
p.add_argument("host")
p.add_argument("port", type=int)
p.add_argument("count", type=int)
p.add_argument("--bind", default="")
p.add_argument("--sport", type=int, default=0)
p.add_argument("--timeout", type=float, default=1.0)
p.add_argument("--path", default="/")
a = p.parse_args()

answers, errors, local = [], {}, ""
start = time.monotonic()
for _ in range(a.count):
    try:
        if a.proto == "http":
            with urllib.request.urlopen(f"http://{a.host}:{a.port}{a.path}", timeout=a.timeout) as r:
                answers.append([str(r.status), ""])
            continue
        kind = socket.SOCK_STREAM if a.proto == "tcp" else socket.SOCK_DGRAM
        s = socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET, kind)
        s.settimeout(a.timeout)
        if a.proto == "tcp":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        if a.sport:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if a.bind or a.sport:
            s.bind((a.bind or ("::" if ":" in a.host else "0.0.0.0"), a.sport))
        with s:
            s.connect((a.host, a.port))
            local = s.getsockname()[0]
            if a.proto == "udp":
                s.send(b"hi")
                data = s.recv(2048)
            else:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = s.recv(2048)
                    if not chunk:
                        break
                    data += chunk
        answers.append(data.decode().split())
    except ConnectionRefusedError:
        errors["refused"] = errors.get("refused", 0) + 1
    except (socket.timeout, TimeoutError):
        errors["timeout"] = errors.get("timeout", 0) + 1
    except OSError as exc:
        key = getattr(exc, "reason", None) or exc.strerror or str(exc)
        if isinstance(key, OSError):
            key = "refused" if isinstance(key, ConnectionRefusedError) else (key.strerror or str(key))
        key = str(key)
        errors[key] = errors.get(key, 0) + 1
print(json.dumps({"answers": answers, "errors": errors, "local": local,
                  "elapsed": time.monotonic() - start}))
