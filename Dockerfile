# clusterdns node agent image.
#
# BASE is any Debian 12 (bookworm) image with Python 3.11 and venv: the
# official python:3.11-slim-bookworm by default (Python in /usr/local), or a
# plain Debian root with python3 and python3-venv (Python from Debian), e.g. one
# built with debootstrap where no registry is reachable (tests/e2e/test_image.py).
# Both stages start from it, so the venv's interpreter links resolve in the runtime.
ARG BASE=python:3.11-slim-bookworm

# --- builder: the virtual environment, trimmed and compiled ------------------
FROM ${BASE} AS builder
# strip (binutils) for the extension modules' symbol tables; this stage only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends binutils \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/clusterdns
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY clusterdns ./clusterdns
COPY scripts/image_slim.py ./
# The git revision the image is built from (no .git is copied in): `clusterdns --version`
# and the build_info series report it. --build-arg REVISION=$(git rev-parse HEAD).
ARG REVISION=""
ARG TREE_STATE=""
# --no-compile: image_slim.py compiles once, after it has removed what is not shipped.
RUN python3 -m venv "$VIRTUAL_ENV" \
 && CLUSTERDNS_REVISION="$REVISION" CLUSTERDNS_TREE_STATE="$TREE_STATE" \
    "$VIRTUAL_ENV/bin/pip" install --no-cache-dir --disable-pip-version-check --no-compile . \
 && "$VIRTUAL_ENV/bin/python" image_slim.py "$VIRTUAL_ENV" \
 && find "$VIRTUAL_ENV" -name '*.so*' -type f -exec strip --strip-unneeded {} + \
 && "$VIRTUAL_ENV/bin/clusterdns" --version \
 && "$VIRTUAL_ENV/bin/python" -c "from kubernetes.aio import client, config; client.ApiClient, client.Configuration, config.load_kube_config"

# --- runtime: the base, the netfilter tools and the venv ---------------------
FROM ${BASE}
# Netfilter and network tools the agent drives. Debian's `iptables` is the
# nf_tables backend; the node's backend must match (iptables-legacy is
# installed too, select it with update-alternatives if the host uses legacy).
# apt's package caches (/var/cache/apt/*.bin, ~78 MB: a debootstrap root has no
# docker-clean hook) and the -old copies dpkg and debconf leave are not kept.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      iptables nftables ipset conntrack iproute2 \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old /var/lib/dpkg/*-old \
           /var/log/apt/* /var/log/dpkg.log /var/log/alternatives.log

COPY --from=builder /opt/clusterdns /opt/clusterdns
# Every module's bytecode is in the image (unchecked-hash); a running agent writes none.
ENV VIRTUAL_ENV=/opt/clusterdns PATH=/opt/clusterdns/bin:$PATH PYTHONDONTWRITEBYTECODE=1
# Runs as root because netfilter in the host network namespace needs
# CAP_NET_ADMIN there; the DaemonSet grants only NET_ADMIN, NET_RAW and
# NET_BIND_SERVICE and drops every other capability.
ENTRYPOINT ["/opt/clusterdns/bin/clusterdns"]
CMD ["agent"]
