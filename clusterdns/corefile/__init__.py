"""Reading a CoreDNS Corefile (and node-local-dns's) and serving it: server blocks,
listeners, and the plugins real clusters use, run in CoreDNS's fixed order."""
