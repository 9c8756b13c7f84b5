"""`kubernetes [ZONES...] { ... }`: the cluster's records from the watched state.

The answers are the DNS engine's (clusterdns/dns/engine.py), the same that
answer without a Corefile: each option maps onto the flag of the same meaning.
Names outside the plugin's zones go to the next plugin without the engine; a
name the engine hands on (fallthrough, an ExternalName's target outside the
zones, an autopath candidate) runs the rest of this block's chain.

The state source is the agent's (--manifest, --kubeconfig, in-cluster), so
`endpoint`, `kubeconfig` and `tls` are refused rather than half-honoured;
`upstream` and `resyncperiod` were removed from CoreDNS in 1.7 and CoreDNS
refuses them too.
"""
from __future__ import annotations

from typing import Any

import dnslib

from ...config import Config
from ..plugin import Next, Plugin, PluginError, Request, SetupContext, match_zone, normalize_zones
from ..syntax import Directive, plugin_error

POD_MODES = ("disabled", "insecure", "verified")
REFUSED_OPTIONS = {
    "endpoint": "the state source is clusterdns's own (--kubeconfig, in-cluster or --manifest)",
    "kubeconfig": "the state source is clusterdns's own (--kubeconfig, in-cluster or --manifest)",
    "tls": "the state source is clusterdns's own (--kubeconfig, in-cluster or --manifest)",
    "labels": "a Service label selector is not supported",
    "multicluster": "multicluster zones are not supported",
    "upstream": "removed in CoreDNS 1.7",
    "resyncperiod": "removed in CoreDNS 1.7",
}


class Kubernetes(Plugin):
    name = "kubernetes"

    def __init__(self, zones: list[str], options: dict, cfg: Config, where: str) -> None:
        self.zones = zones
        self.options = options
        self.where = where
        self.cfg = cfg.with_options(zones=tuple(z.rstrip(".") for z in zones), no_upstream=False, **options)
        self.engine: Any = None   # made by the server block (shared between equal configurations)

    def config_key(self) -> tuple:
        return tuple(sorted(self.cfg.dns.__dict__.items()))

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        if match_zone(self.zones, req.qname) is None:
            return await next(req)
        req.data["kubernetes.next"] = next
        q = req.record
        if req.wire and _same_question(req):
            wire = req.wire
        else:
            wire = bytes(q.pack())
        reply = await self.engine.resolve(wire, req.client[0], req.tcp)
        err = req.data.pop("kubernetes.error", None)
        if err is not None:
            raise err
        if isinstance(reply, list):
            req.data["xfr"] = reply
            return dnslib.DNSRecord.parse(reply[0]) if reply else req.reply()
        if reply is None:
            raise PluginError(2, "plugin/kubernetes: no reply")
        req.note("kubernetes")
        return dnslib.DNSRecord.parse(reply)

    def transparent(self, qname: str, qtype: int) -> bool:
        return False

    def describe(self) -> str:
        d = self.cfg.dns
        parts = [" ".join(self.zones), f"pods {d.pods}", f"ttl {d.ttl}"]
        if d.fallthrough is not None:
            parts.append("fallthrough " + " ".join(d.fallthrough or ("(all)",)))
        for flag, on in (("endpoint_pod_names", d.endpoint_pod_names), ("noendpoints", d.noendpoints),
                         ("ignore empty_service", d.ignore_empty_service), ("autopath", d.autopath)):
            if on:
                parts.append(flag)
        if d.namespaces:
            parts.append("namespaces " + " ".join(d.namespaces))
        if d.namespace_labels:
            parts.append("namespace_labels " + d.namespace_labels)
        text = "; ".join(parts)
        if getattr(self, "implicit", False):
            text += " (the cluster DNS this block forwards to, answered in-process)"
        return text


def _same_question(req: Request) -> bool:
    """Is req.record's question still the one on the wire (no rewrite in front)?"""
    q = req.record.q
    return req.data.get("question") == (str(q.qname), q.qtype, q.qclass)


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    zones = normalize_zones(d.values, ctx.zones, d, "kubernetes")
    if "." in zones:
        raise plugin_error(d, "the root zone cannot be served from the cluster state; name the cluster zone")
    options: dict = {}
    for line in d.lines():
        args = line.values
        name = line.name
        if name in REFUSED_OPTIONS:
            raise plugin_error(line, f"{name}: not supported: {REFUSED_OPTIONS[name]}", "kubernetes")
        if name == "pods":
            if len(args) != 1 or args[0] not in POD_MODES:
                raise plugin_error(line, f"pods: expected one of {', '.join(POD_MODES)}", "kubernetes")
            options["pods"] = args[0]
        elif name == "ttl":
            try:
                ttl = int(args[0]) if len(args) == 1 else -1
            except ValueError:
                ttl = -1
            if not 0 <= ttl <= 3600:
                raise plugin_error(line, f"ttl must be in range [0, 3600]: {' '.join(args)}", "kubernetes")
            options["ttl"] = ttl
        elif name == "fallthrough":
            options["fallthrough"] = tuple(z.rstrip(".") for z in normalize_zones(args, [], line, "kubernetes")) if args else ()
        elif name == "namespaces":
            if not args:
                raise plugin_error(line, "namespaces: at least one namespace", "kubernetes")
            options["namespaces"] = tuple(args)
        elif name == "namespace_labels":
            if not args:
                raise plugin_error(line, "namespace_labels: a label selector", "kubernetes")
            options["namespace_labels"] = " ".join(args)
        elif name == "endpoint_pod_names" and not args:
            options["endpoint_pod_names"] = True
        elif name == "noendpoints" and not args:
            options["noendpoints"] = True
        elif name == "ignore" and args == ["empty_service"]:
            options["ignore_empty_service"] = True
        elif name == "startup_timeout" and len(args) == 1:
            pass   # /ready waits for the first sync whatever the timeout (no answers before it)
        else:
            raise plugin_error(line, f"unknown property '{name}'", "kubernetes")
    if "namespaces" in options and "namespace_labels" in options:
        raise plugin_error(d, "namespaces and namespace_labels cannot both be set")
    if ctx.cfg is None:
        ctx.cfg = Config()
    return Kubernetes(zones, options, ctx.cfg, d.where)


def tail_query(plugin: Kubernetes):
    """The engine's forwarder: a name it does not answer goes on down the current request's
    chain (after kubernetes)."""
    from ..runtime import current

    class _Tail:
        async def query(self, request: dnslib.DNSRecord, tcp: bool) -> dnslib.DNSRecord | None:
            req = current.get()
            if req is None:
                return None
            nxt = req.data.get("kubernetes.next")
            if nxt is None:
                return None
            sub = Request(record=request, client=req.client, tcp=tcp, server=req.server, zone=req.zone,
                          size=req.size, trail=req.trail, data={"block": req.data.get("block")})
            try:
                return await nxt(sub)
            except PluginError as exc:
                req.data["kubernetes.error"] = exc
                return None
    return _Tail()
