# clusterdns node agent image.
# Debian release pinned in the tag; Python from the image, not Debian's.
FROM python:3.11-slim-bookworm

# Netfilter and network tools the agent drives. Debian's `iptables` is the
# nf_tables backend; the node's backend must match (iptables-legacy is
# installed too, select it with update-alternatives if the host uses legacy).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      iptables nftables ipset conntrack iproute2 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY clusterdns ./clusterdns
RUN pip install --no-cache-dir ".[fast]" && rm -rf /src

WORKDIR /
# Runs as root because netfilter in the host network namespace needs
# CAP_NET_ADMIN there; the DaemonSet grants only NET_ADMIN, NET_RAW and
# NET_BIND_SERVICE and drops every other capability.
ENTRYPOINT ["clusterdns"]
CMD ["agent"]
