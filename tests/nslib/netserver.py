"""Backend for the namespace tests: answers "<name> <peer address>" on TCP and UDP, IPv4 and IPv6.

Usage: netserver.py NAME TCP_PORT UDP_PORT  (run inside a pod namespace)
The peer address tells the test whether the packet was masqueraded.
"""
import socket
import socketserver
import sys
import threading

NAME = sys.argv[1]


class Tcp(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(f"{NAME} {self.client_address[0]}\n".encode())


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class Server6(Server):
    address_family = socket.AF_INET6

    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()


def udp(port, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_DGRAM)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind(("0.0.0.0" if family == socket.AF_INET else "::", port))
    while True:
        _, peer = s.recvfrom(2048)
        s.sendto(f"{NAME} {peer[0]}\n".encode(), peer)


threading.Thread(target=udp, args=(int(sys.argv[3]),), daemon=True).start()
threading.Thread(target=udp, args=(int(sys.argv[3]), socket.AF_INET6), daemon=True).start()
threading.Thread(target=Server6(("::", int(sys.argv[2])), Tcp).serve_forever, daemon=True).start()
Server(("0.0.0.0", int(sys.argv[2])), Tcp).serve_forever()
