"""Backend for the namespace tests: answers "<name> <peer address>" on TCP and UDP.

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


def udp(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    while True:
        _, peer = s.recvfrom(2048)
        s.sendto(f"{NAME} {peer[0]}\n".encode(), peer)


threading.Thread(target=udp, args=(int(sys.argv[3]),), daemon=True).start()
Server(("0.0.0.0", int(sys.argv[2])), Tcp).serve_forever()
