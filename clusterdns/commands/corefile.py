"""`clusterdns corefile --from-kube-dns FILE`: print the Corefile a kube-dns ConfigMap
translates to (clusterdns/corefile/kubedns.py), and exit.

FILE is YAML: the ConfigMap (`kubectl get configmap -n kube-system kube-dns -o yaml`)
or just its data mapping; `-` reads standard input. What the translation leaves out
is said on standard error; input it cannot translate exits 2 naming the key.
"""
from __future__ import annotations

import sys

from ..config import Config
from ..corefile.kubedns import KubeDNSError, check_domain, corefile_from_kube_dns, data_from_yaml
from ..errors import UsageError


def run(cfg: Config) -> int:
    path = cfg.run.from_kube_dns
    if not path:
        raise UsageError("corefile: nothing to translate; give --from-kube-dns FILE")
    domain = check_domain(cfg.run.cluster_domain)
    try:
        if path == "-":
            text, source = sys.stdin.read(), "<stdin>"
        else:
            with open(path, encoding="utf-8") as fh:
                text, source = fh.read(), path
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text") from None
    data = data_from_yaml(text, source)
    notes: list[str] = []
    try:
        corefile = corefile_from_kube_dns(data, domain, notes=notes)
    except KubeDNSError as exc:
        raise KubeDNSError(f"{source}: {exc}") from None
    for note in notes:
        print(f"clusterdns: {source}: {note}", file=sys.stderr)
    sys.stdout.write(corefile)
    sys.stdout.flush()
    return 0
