"""A stub upstream DNS server for the namespace tests: `stubdns.py IP PORT TAG`.

Answers every A question with 192.0.2.TAG (TTL 60) and TXT with "TAG", names starting
with `nx.` with NXDOMAIN (an SOA in authority), over UDP and TCP, until killed."""
from __future__ import annotations

import socket
import socketserver
import struct
import sys
import threading

import dns.message
import dns.rcode
import dns.rrset

IP, PORT, TAG = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def answer(wire: bytes) -> bytes:
    q = dns.message.from_wire(wire)
    r = dns.message.make_response(q)
    r.flags |= 0x80    # RA
    name = q.question[0].name
    rdtype = q.question[0].rdtype
    if name.to_text().lower().startswith("nx."):
        r.set_rcode(dns.rcode.NXDOMAIN)
        r.authority.append(dns.rrset.from_text(name.parent(), 30, "IN", "SOA", "ns. host. 1 7200 1800 86400 30"))
    elif rdtype == 1:
        r.answer.append(dns.rrset.from_text(name, 60, "IN", "A", f"192.0.2.{TAG}"))
    elif rdtype == 16:
        r.answer.append(dns.rrset.from_text(name, 60, "IN", "TXT", f'"{TAG}"'))
    return r.to_wire()


class UDP(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data, sock = self.request
        try:
            sock.sendto(answer(data), self.client_address)
        except Exception:
            pass


class TCP(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while True:
                head = self.request.recv(2)
                if len(head) < 2:
                    return
                n = struct.unpack("!H", head)[0]
                data = b""
                while len(data) < n:
                    chunk = self.request.recv(n - len(data))
                    if not chunk:
                        return
                    data += chunk
                out = answer(data)
                self.request.sendall(struct.pack("!H", len(out)) + out)
        except OSError:
            return


class UDPServer(socketserver.ThreadingUDPServer):
    address_family = socket.AF_INET6 if ":" in IP else socket.AF_INET
    allow_reuse_address = True


class TCPServer(socketserver.ThreadingTCPServer):
    address_family = socket.AF_INET6 if ":" in IP else socket.AF_INET
    allow_reuse_address = True
    daemon_threads = True


if __name__ == "__main__":
    u, t = UDPServer((IP, PORT), UDP), TCPServer((IP, PORT), TCP)
    threading.Thread(target=t.serve_forever, daemon=True).start()
    print("ready", flush=True)
    u.serve_forever()
