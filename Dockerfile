# clusterdns node agent image.
#
# BASE is any Debian 12 (bookworm) image with Python 3.11 and venv: the
# official python:3.11-slim-bookworm by default (Python in /usr/local), or a
# plain Debian root with python3 and python3-venv (Python from Debian), e.g. one
# built with debootstrap where no registry is reachable (tests/e2e/test_image.py).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# Netfilter and network tools the agent drives. Debian's `iptables` is the
# nf_tables backend; the node's backend must match (iptables-legacy is
# installed too, select it with update-alternatives if the host uses legacy).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      iptables nftables ipset conntrack iproute2 \
 && rm -rf /var/lib/apt/lists/*

# A virtual environment: the same layout whichever Python the base has, and
# nothing installed into (or refused by, PEP 668) the system's Python.
ENV VIRTUAL_ENV=/opt/clusterdns PATH=/opt/clusterdns/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY clusterdns ./clusterdns
# The git revision the image is built from (no .git is copied in): `clusterdns --version`
# and the build_info series report it. --build-arg REVISION=$(git rev-parse HEAD).
ARG REVISION=""
ARG TREE_STATE=""
RUN python3 -m venv "$VIRTUAL_ENV" \
 && CLUSTERDNS_REVISION="$REVISION" CLUSTERDNS_TREE_STATE="$TREE_STATE" \
    "$VIRTUAL_ENV/bin/pip" install --no-cache-dir --disable-pip-version-check . \
 && rm -rf /src \
 && "$VIRTUAL_ENV/bin/clusterdns" --help >/dev/null

WORKDIR /
# Runs as root because netfilter in the host network namespace needs
# CAP_NET_ADMIN there; the DaemonSet grants only NET_ADMIN, NET_RAW and
# NET_BIND_SERVICE and drops every other capability.
ENTRYPOINT ["/opt/clusterdns/bin/clusterdns"]
CMD ["agent"]
