"""The one reader of iptables-save output (and of iptables-restore text, its superset).

`read(text)` splits a dump into tables, chains (with their policies) and
rules in order; everything that looks at iptables rules in the kernel (stale
chains, jumps already present, cleanup, what a previous process programmed)
goes through it. `programmed(save)` follows nat KUBE-SERVICES -> KUBE-SVC/
KUBE-SVL -> KUBE-SEP DNAT targets: what a previous clusterdns (or kube-proxy,
same layout) left in the kernel, for the agent's restart adoption.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rule:
    chain: str
    spec: str        # everything after "-A CHAIN " (what `iptables -C CHAIN` takes)
    line: str        # the line as written ("-A ..." in a dump; "-I ..." may appear in restore text)


@dataclass
class Table:
    name: str
    chains: dict[str, str] = field(default_factory=dict)   # chain -> policy ("-" for user chains)
    rules: list[Rule] = field(default_factory=list)

    def rules_of(self, chain: str) -> list[Rule]:
        return [r for r in self.rules if r.chain == chain]

    def by_chain(self) -> dict[str, list[Rule]]:
        out: dict[str, list[Rule]] = {}
        for r in self.rules:
            out.setdefault(r.chain, []).append(r)
        return out


def read(text: str) -> dict[str, Table]:
    """Tables of an iptables-save dump (or restore text); -A and -I lines are rules."""
    tables: dict[str, Table] = {}
    table: Table | None = None
    for line in text.splitlines():
        if not line:
            continue
        c = line[0]
        if c == "-" and table is not None and line[:3] in ("-A ", "-I "):
            rest = line[3:]
            sp = rest.find(" ")
            chain, spec = (rest, "") if sp < 0 else (rest[:sp], rest[sp + 1:])
            table.rules.append(Rule(chain, spec, line))
        elif c == ":" and table is not None:
            parts = line[1:].split()
            if parts:
                table.chains[parts[0]] = parts[1] if len(parts) > 1 else "-"
        elif c == "*":
            table = tables.setdefault(line[1:].strip(), Table(line[1:].strip()))
        elif line == "COMMIT":
            table = None
    return tables


def chains(text: str, prefix: str = "") -> dict[str, set[str]]:
    """Chains per table, keeping names that start with `prefix`."""
    return {name: {c for c in t.chains if c.startswith(prefix)} for name, t in read(text).items()}


def summary(text: str, prefix: str = "KUBE-") -> tuple[dict[str, set[str]], set[tuple[str, str, str]]]:
    """What a full sync needs from a dump, in one light pass (300,000 lines at scale):
    chains starting with `prefix` per table, and (table, chain, spec) of the rules of
    every chain that does not (the built-in chains' jumps). No per-rule objects."""
    chains: dict[str, set[str]] = {}
    others: set[tuple[str, str, str]] = set()
    table = ""
    cur: set[str] = set()
    skip = "-A " + prefix
    for line in text.splitlines():
        if line.startswith("-A "):
            if line.startswith(skip) or not table:
                continue
            rest = line[3:]
            sp = rest.find(" ")
            others.add((table, rest, "") if sp < 0 else (table, rest[:sp], rest[sp + 1:]))
        elif line.startswith(":"):
            if table:
                name = line[1:].split(" ", 1)[0]
                if name.startswith(prefix):
                    cur.add(name)
        elif line.startswith("*"):
            table = line[1:].strip()
            cur = chains.setdefault(table, set())
        elif line == "COMMIT":
            table = ""
    return chains, others


def count_rules(text: str) -> int:
    """Rules in a dump (a plain count: the backend choice counts 300,000 lines at scale)."""
    return text.count("\n-A ") + text.startswith("-A ")


def present(text: str) -> set[tuple[str, str, str]]:
    """(table, chain, spec) of every rule in a dump."""
    return {(name, r.chain, r.spec) for name, t in read(text).items() for r in t.rules}


_COMMENT = re.compile(r'-m comment --comment (?:"(?:[^"\\]|\\.)*"|\S+) ?')


def target(spec: str) -> str:
    """The -j target of a rule spec ('' when it has none)."""
    if "--comment" in spec:
        spec = _COMMENT.sub("", spec)
    i = spec.find("-j ")
    while i > 0 and spec[i - 1] != " ":
        i = spec.find("-j ", i + 1)
    if i < 0:
        return ""
    rest = spec[i + 3:]
    sp = rest.find(" ")
    return rest if sp < 0 else rest[:sp]


def tokens(spec: str) -> list[str]:
    """The words of a rule spec with its comment match removed (comments may hold spaces)."""
    if "--comment" in spec:
        spec = _COMMENT.sub("", spec)
    return spec.split()


def _option(words: list[str], name: str) -> str | None:
    try:
        i = words.index(name)
    except ValueError:
        return None
    if i > 0 and words[i - 1] == "!":
        return None    # a negated match is not the rule's address
    return words[i + 1] if i + 1 < len(words) else None


def _address(value: str | None) -> str | None:
    """'10.96.0.5/32' -> '10.96.0.5'; a wider prefix is not one Service address."""
    if not value:
        return None
    ip, _, plen = value.partition("/")
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if plen and int(plen) != addr.max_prefixlen:
        return None
    return str(addr)


ServiceKey = tuple[str, str, int]    # (ClusterIP, protocol upper case, port)


def _service_rule(spec: str) -> tuple[ServiceKey, str] | None:
    words = tokens(spec)
    ip = _address(_option(words, "-d"))
    proto = _option(words, "-p")
    port = _option(words, "--dport")
    jump = _option(words, "-j")
    if ip is None or not proto or not port or not port.isdigit() or not jump:
        return None
    return (ip, proto.upper(), int(port)), jump


def programmed(nat: str, filter_text: str = "") -> dict[ServiceKey, frozenset[str]]:
    """(ClusterIP, protocol, port) -> the "ip:port" endpoints its rules DNAT to, from
    `iptables-save -t nat` (and `-t filter`: ClusterIP ports that REJECT or DROP,
    having no usable endpoints, map to an empty set). Either text may be a dump of
    every table; only its nat (filter) table is read.

    The endpoints are those of both the Cluster and the Local dispatch chain of the
    port (KUBE-SVC-h, KUBE-SVL-h), whichever the ClusterIP jumps to. One pass over
    the lines (about 430,000 at 10,000 Services x 10 endpoints), no per-rule objects."""
    seps: dict[str, list[str]] = {}      # dispatch chain -> KUBE-SEP targets
    dnat: dict[str, str] = {}            # KUBE-SEP chain -> ip:port
    entries: list[tuple[ServiceKey, str]] = []
    table = ""
    for line in nat.splitlines():
        if line.startswith("-A KUBE-"):
            if table != "nat":
                continue
            if line.startswith("-A KUBE-SEP-"):
                i = line.find(" --to-destination ")
                if i > 0:
                    chain = line[3:line.index(" ", 3)]
                    dnat[chain] = line[i + 18:].split(" ", 1)[0]
            elif line.startswith(("-A KUBE-SVC-", "-A KUBE-SVL-")):
                # a jump to a chain is the last word (targets with options are never KUBE-SEP)
                tgt = line[line.rfind(" ") + 1:]
                if tgt.startswith("KUBE-SEP-"):
                    seps.setdefault(line[3:line.index(" ", 3)], []).append(tgt)
            elif line.startswith("-A KUBE-SERVICES "):
                hit = _service_rule(line[17:])
                if hit is not None and hit[1].startswith(("KUBE-SVC-", "KUBE-SVL-")):
                    entries.append(hit)
        elif line.startswith("*"):
            table = line[1:].strip()
    out: dict[ServiceKey, frozenset[str]] = {}
    for key, chain in entries:
        h = chain[9:]
        eps = {dnat[s] for c in ("KUBE-SVC-" + h, "KUBE-SVL-" + h) for s in seps.get(c, ()) if s in dnat}
        out[key] = out.get(key, frozenset()) | frozenset(eps)
    f = read(_table_text(filter_text, "filter")).get("filter") if filter_text else None
    if f is not None:
        for r in f.rules:
            if r.chain != "KUBE-SERVICES":
                continue
            hit = _service_rule(r.spec)
            if hit is not None and hit[1] in ("REJECT", "DROP"):
                out.setdefault(hit[0], frozenset())
    return out


def _table_text(text: str, name: str) -> str:
    """The part of a dump holding one table (the filter table is small; nat is not)."""
    start = text.find(f"*{name}\n")
    if start < 0:
        return ""
    end = text.find("\nCOMMIT", start)
    return text[start:] if end < 0 else text[start:end + 8]


__all__ = ["Rule", "Table", "chains", "count_rules", "present", "programmed", "read", "summary", "target",
           "tokens"]
