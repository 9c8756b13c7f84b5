import copy
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterdns.sources.objects import InvalidObject, convert

SERVICE = {
    "apiVersion": "v1", "kind": "Service",
    "metadata": {"name": "web", "namespace": "shop"},
    "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.5", "clusterIPs": ["10.96.0.5", "fd00::5"],
             "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
}

SLICE = {
    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
    "metadata": {"name": "web-abc", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"},
                 "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-02T03:04:05Z"}},
    "addressType": "IPv4",
    "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "nodeName": "n1", "hostname": "web-0"},
        {"addresses": ["10.0.0.2"], "conditions": {}},
        {"addresses": ["10.0.0.3"], "conditions": {"ready": False, "serving": True, "terminating": True}},
    ],
    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
}


def with_(obj, path, value):
    obj = copy.deepcopy(obj)
    *parents, last = path
    cur = obj
    for p in parents:
        cur = cur[p]
    cur[last] = value
    return obj


def test_service_dual_stack_and_ports():
    svc = convert("Service", SERVICE)
    assert svc.cluster_ips == ("10.96.0.5", "fd00::5")
    assert svc.ports[0].name == "http" and svc.ports[0].port == 80
    assert not svc.headless and svc.key == ("shop", "web")


def test_headless_and_external_name():
    headless = convert("Service", with_(with_(SERVICE, ["spec", "clusterIPs"], ["None"]), ["spec", "clusterIP"], "None"))
    assert headless.headless and headless.cluster_ips == ()
    ext = convert("Service", {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "namespace": "a"},
                              "spec": {"type": "ExternalName", "externalName": "DB.Example.com."}})
    assert ext.is_external_name and ext.external_name == "db.example.com"


@pytest.mark.parametrize("path,value,message", [
    (["spec", "clusterIPs"], [167772165], "must be a string"),          # YAML integer, not an address
    (["spec", "clusterIPs"], ["10.96.0.300"], "invalid IP"),
    (["spec", "ports"], [{"port": "eighty"}], "port must be an integer"),
    (["spec", "ports"], [{"port": 70000}], "out of range"),
    (["spec", "ports"], [{"port": 80, "protocol": "ICMP"}], "unsupported protocol"),
    (["spec", "type"], "Weird", "unknown service type"),
    (["metadata"], "oops", "metadata"),
    (["spec", "sessionAffinity"], "Sticky", "sessionAffinity"),
])
def test_invalid_service_is_rejected_with_reason(path, value, message):
    with pytest.raises(InvalidObject, match=message):
        convert("Service", with_(SERVICE, path, value))


def test_endpointslice_conditions_default_to_ready():
    sl = convert("EndpointSlice", SLICE)
    a, b, c = sl.endpoints
    assert (a.ready, a.serving, a.terminating, a.hostname, a.node_name) == (True, True, False, "web-0", "n1")
    assert (b.ready, b.serving) == (True, True)          # absent counts as ready
    assert (c.ready, c.serving, c.terminating) == (False, True, True)
    assert sl.service_key == ("shop", "web")
    assert sl.trigger_time == pytest.approx(1767323045.0)


@pytest.mark.parametrize("path,value,message", [
    (["metadata", "labels"], {}, "service-name"),
    (["addressType"], "IPv5", "addressType"),
    (["endpoints", 0, "addresses"], ["fd00::1"], "not of addressType"),
    (["endpoints", 0, "conditions", "ready"], "yes", "expected a boolean"),
    (["endpoints", 0, "hostname"], "Not_A_Label", "DNS-1123 label"),
])
def test_invalid_slice_is_rejected(path, value, message):
    with pytest.raises(InvalidObject, match=message):
        convert("EndpointSlice", with_(SLICE, path, value))


def test_loadbalancer_fields_normalised():
    lb = with_(SERVICE, ["spec"], {
        "type": "LoadBalancer", "clusterIP": "10.96.0.9", "externalTrafficPolicy": "Local",
        "healthCheckNodePort": 32000, "loadBalancerSourceRanges": [" 203.0.113.000/025 "],
        "ports": [{"port": 80, "nodePort": 30080}]})
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}, {"ip": "198.51.100.2", "ipMode": "Proxy"}]}}
    svc = convert("Service", lb)
    assert svc.lb_ips == ("198.51.100.1",)
    assert svc.lb_source_ranges == ("203.0.113.0/25",)
    assert svc.external_local and svc.health_check_node_port == 32000
    assert svc.ports[0].node_port == 30080 and svc.ports[0].protocol == "TCP"


def test_pod_and_node():
    pod = convert("Pod", {"metadata": {"name": "p", "namespace": "a", "deletionTimestamp": "x"},
                          "status": {"podIPs": [{"ip": "10.0.0.9"}], "phase": "Running"}})
    assert pod.ips == ("10.0.0.9",) and not pod.live
    node = convert("Node", {"metadata": {"name": "n", "labels": {"topology.kubernetes.io/zone": "z1"}},
                            "status": {"addresses": [{"type": "Hostname", "address": "n"},
                                                     {"type": "ExternalIP", "address": "1.2.3.4"},
                                                     {"type": "InternalIP", "address": "10.1.1.1"}]}})
    assert node.addresses == ("10.1.1.1", "1.2.3.4") and node.zone == "z1"


# -- names and fields as the API server validates them (hostile input must never reach rules or records)

HOSTILE = ["sp ace", 'qu"ote', "semi;colon", "caf\u00e9", "MySvc", "my_svc", "new\nline", "a" * 64, "-lead",
           "trail-", "x.y", "", "tab\t", "back\\slash", "{brace}", "d\u0131\u0307"]


@pytest.mark.parametrize("name", HOSTILE + ["1starts-with-digit"])
def test_service_name_must_be_a_dns1035_label(name):
    with pytest.raises(InvalidObject):
        convert("Service", with_(SERVICE, ["metadata", "name"], name))


@pytest.mark.parametrize("ns", [n for n in HOSTILE if n] + ["n" * 70])
def test_namespace_must_be_a_dns1123_label(ns):
    with pytest.raises(InvalidObject):
        convert("Service", with_(SERVICE, ["metadata", "namespace"], ns))
    with pytest.raises(InvalidObject):
        convert("EndpointSlice", with_(SLICE, ["metadata", "namespace"], ns))
    with pytest.raises(InvalidObject):
        convert("Namespace", {"metadata": {"name": ns}})


def test_longest_valid_names_are_kept():
    svc = convert("Service", with_(with_(SERVICE, ["metadata", "name"], "s" * 63), ["metadata", "namespace"], "9" * 63))
    assert svc.key == ("9" * 63, "s" * 63)
    assert convert("Service", with_(SERVICE, ["metadata", "name"], "a-1")).name == "a-1"


@pytest.mark.parametrize("pname", [n for n in HOSTILE if n])
def test_port_names_must_be_dns1123_labels(pname):
    with pytest.raises(InvalidObject, match="port name"):
        convert("Service", with_(SERVICE, ["spec", "ports"], [{"name": pname, "port": 80}]))
    with pytest.raises(InvalidObject, match="port name"):
        convert("EndpointSlice", with_(SLICE, ["ports"], [{"name": pname, "port": 80}]))


@pytest.mark.parametrize("target,ok", [
    (8080, True), ("http", True), ("h-2", True), ("a" * 15, True),
    (0, False), (70000, False), ("8080", False), ("a" * 16, False), ("a--b", False), ("-a", False),
    ("HTTP", False), ("a b", False), (1.5, False), (True, False), ([80], False),
])
def test_target_port_is_a_port_or_an_iana_service_name(target, ok):
    obj = with_(SERVICE, ["spec", "ports"], [{"name": "http", "port": 80, "targetPort": target}])
    if ok:
        assert convert("Service", obj).ports[0].target_port == target
    else:
        with pytest.raises(InvalidObject, match="targetPort"):
            convert("Service", obj)


@pytest.mark.parametrize("path,value,message", [
    (["spec", "ports"], [{"port": 80, "protocol": "tcp"}], "unsupported protocol"),
    (["spec", "ports"], [{"port": 0}], "out of range"),
    (["spec", "ports"], [{"port": 80, "nodePort": 65536}], "out of range"),
    (["spec", "ports"], [{"port": True}], "must be an integer"),
    (["spec", "clusterIPs"], [" 10.96.0.5"], "invalid IP"),
    (["spec", "clusterIPs"], ["fe80::1%eth0"], "invalid IP"),
    (["spec", "clusterIPs"], ["010.096.000.005"], "invalid IP"),
    (["spec", "externalIPs"], [3232235777], "must be a string"),
    (["spec", "externalTrafficPolicy"], "Everywhere", "externalTrafficPolicy"),
    (["spec", "internalTrafficPolicy"], "local", "internalTrafficPolicy"),
    (["metadata", "labels"], {"service.kubernetes.io/service-proxy-name": "a b"}, "label value"),
    (["metadata", "labels"], {"app": ["not", "a", "string"]}, "labels"),
])
def test_more_invalid_service_fields(path, value, message):
    with pytest.raises(InvalidObject, match=message):
        convert("Service", with_(SERVICE, path, value))


@pytest.mark.parametrize("path,value,message", [
    (["metadata", "labels"], {"kubernetes.io/service-name": "Web"}, "Service name"),
    (["metadata", "labels"], {"kubernetes.io/service-name": "web;drop"}, "Service name"),
    (["metadata", "name"], "web abc", "DNS-1123 subdomain"),
    (["endpoints", 0, "nodeName"], "node 1", "node name"),
    (["endpoints", 0, "nodeName"], 7, "expected string"),
    (["endpoints", 0, "zone"], "zone\"1", "zone"),
    (["endpoints", 0, "targetRef"], {"kind": "Pod", "name": "p\u00e9"}, "Pod name"),
    (["endpoints", 0, "addresses"], ["10.0.0.1 "], "invalid IP"),
    (["endpoints", 0, "addresses"], [167772161], "must be a string"),
    (["endpoints", 0, "addresses"], [], "non-empty"),
    (["ports"], [{"port": 80, "protocol": "ICMP"}], "unsupported protocol"),
    (["ports"], ["80"], "expected a mapping"),
])
def test_more_invalid_slice_fields(path, value, message):
    with pytest.raises(InvalidObject, match=message):
        convert("EndpointSlice", with_(SLICE, path, value))


def test_fqdn_slice_addresses_must_be_names():
    fqdn = with_(SLICE, ["addressType"], "FQDN")
    fqdn = with_(fqdn, ["endpoints"], [{"addresses": ["db.example.com"]}])
    assert convert("EndpointSlice", fqdn).endpoints[0].addresses == ("db.example.com",)
    with pytest.raises(InvalidObject, match="FQDN"):
        convert("EndpointSlice", with_(fqdn, ["endpoints"], [{"addresses": ["db example;com"]}]))


def test_ipv6_addresses_are_canonicalised():
    sl = with_(with_(SLICE, ["addressType"], "IPv6"), ["endpoints"], [{"addresses": ["FD00:0::01"]}])
    assert convert("EndpointSlice", sl).endpoints[0].addresses == ("fd00::1",)



_PORT_VALUES = [None, 0, 1, 80, 65535, 65536, -1, True, False, 8.0, "", "http", "8080", "HTTP", "a-b", "-a",
                "x" * 16, "TCP", "UDP", "SCTP", "tcp", [], {}, ["TCP"]]


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(["name", "protocol", "port", "nodePort", "targetPort"]),
                       st.sampled_from(_PORT_VALUES)) | st.sampled_from([None, [], "port", 80]))
def test_the_plain_port_path_agrees_with_the_checked_one(p):
    from clusterdns.sources.objects import InvalidObject, _checked_port, _plain_port

    def outcome(fn):   # repr: True and 1 are equal, not the same
        try:
            return repr(fn())
        except (InvalidObject, AttributeError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}"
    assert outcome(lambda: _plain_port(p) or _checked_port(p, "spec.ports[0]")) == \
        outcome(lambda: _checked_port(p, "spec.ports[0]"))


@pytest.mark.parametrize("port", [8080.0, True, "8080"])
def test_a_port_equal_to_a_seen_one_but_of_another_type_is_still_invalid(port):
    first = convert("EndpointSlice", SLICE)   # (http, TCP, 8080) is now remembered
    again = convert("EndpointSlice", copy.deepcopy(SLICE))
    assert again.ports[0] is first.ports[0]   # one shared record
    with pytest.raises(InvalidObject, match="port must be an integer"):
        convert("EndpointSlice", with_(SLICE, ["ports"], [{"name": "http", "port": port, "protocol": "TCP"}]))
    with pytest.raises(InvalidObject, match="port must be an integer"):
        convert("Service", with_(SERVICE, ["spec", "ports"], [{"name": "http", "port": port, "protocol": "TCP"}]))


_COND_VALUES = [None, True, False, 1, 0, "true", []]
_COMMON = 4   # the common (valid) values listed this many times: most examples reach the inline path
_ENDPOINT_FIELDS = {
    "addresses": st.sampled_from([["10.0.0.1"]] * _COMMON + [
        None, [], ["10.0.0.01"], ["10.0.0.1", "10.0.0.2"], ["fd00::1"], [" 10.0.0.1"], [167772161], "10.0.0.1"]),
    "conditions": st.none() | st.sampled_from([{}, [], "ready"]) | st.dictionaries(
        st.sampled_from(["ready", "serving", "terminating"]), st.sampled_from(_COND_VALUES)),
    "hostname": st.sampled_from([None, "", "web-0", "Web", "a.b", 7]),
    "nodeName": st.sampled_from(["n1"] * _COMMON + [None, "", "node.example", "node 1", "N1", 7, 0, False]),
    "zone": st.sampled_from(["zone-a"] * _COMMON + [None, "", "Zone_A.1", "zone\"1", "-z", 7, 0, False]),
    "targetRef": st.sampled_from([{"kind": "Pod", "name": "web-0", "namespace": "shop"}] * _COMMON + [
        None, [], {}, {"kind": "Pod", "name": "web-0"}, {"kind": "Pod", "name": "web-0", "namespace": "other"},
        {"kind": "Pod", "name": "web-0", "namespace": "Bad"}, {"kind": "Pod", "name": "Web"},
        {"kind": "Pod", "name": 5}, {"kind": "Pod", "name": ""}, {"kind": "Node", "name": "n1"},
        {"kind": "Pod", "name": 0}, {"kind": "Pod", "name": "web-0", "namespace": False},
        {"kind": "Pod", "name": "web-0", "namespace": ""}, {"kind": "Pod", "name": "web-0", "namespace": 0}]),
    "hints": st.sampled_from([None, {}, {"forZones": [{"name": "zone-a"}]}, []]),
}


_VALID_ENDPOINT = {"addresses": ["10.0.0.1"], "conditions": {"ready": True, "serving": True, "terminating": False},
                   "hostname": "web-0", "nodeName": "n1", "zone": "zone-a",
                   "targetRef": {"kind": "Pod", "name": "web-0", "namespace": "shop"}}


def _endpoints():
    """A valid endpoint with a few fields left out or changed, or anything of the fields' values."""
    def changed(args):
        dropped, changes = args
        ep = {k: v for k, v in copy.deepcopy(_VALID_ENDPOINT).items() if k not in dropped}
        ep.update(changes)
        return ep
    one = st.sampled_from(sorted(_ENDPOINT_FIELDS)).flatmap(
        lambda k: st.tuples(st.just(k), _ENDPOINT_FIELDS[k]))
    mixed = st.tuples(st.sets(st.sampled_from(sorted(_VALID_ENDPOINT))),
                      st.lists(one, max_size=2).map(dict)).map(changed)
    conditions = st.dictionaries(st.sampled_from(["ready", "serving", "terminating"]),
                                 st.sampled_from(_COND_VALUES)).map(lambda c: {**_VALID_ENDPOINT, "conditions": c})
    return mixed | conditions | st.fixed_dictionaries({}, optional=_ENDPOINT_FIELDS) \
        | st.sampled_from([None, [], "10.0.0.1"])


@settings(max_examples=1500, deadline=None)
@given(_endpoints(), st.booleans())
def test_the_plain_endpoint_path_agrees_with_the_checked_one(ep, remembered):
    """_plain_endpoints (IPv4 slices' endpoints inline) takes or refuses what _endpoint does, with
    the same record or message, whether or not the names it reads from the memos are in them."""
    from clusterdns.sources import objects

    if not remembered:
        for memo in objects._SEEN.values():
            memo.clear()

    def outcome(fn):   # repr: True and 1 are equal, not the same
        try:
            return repr(fn())
        except (InvalidObject, AttributeError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}"
    checked = outcome(lambda: [objects._endpoint(ep, 0, "IPv4", "shop")])
    assert outcome(lambda: objects._plain_endpoints([ep], "shop")) == checked
    assert outcome(lambda: objects._plain_endpoints([ep], "shop")) == checked   # now with the memos filled


@pytest.mark.parametrize("value", [1, 0])
def test_a_condition_equal_to_a_seen_boolean_is_still_invalid(value):
    for atype, address in (("IPv4", "10.0.0.1"), ("IPv6", "fd00::1")):
        sl = with_(with_(SLICE, ["addressType"], atype), ["endpoints"],
                   [{"addresses": [address], "conditions": {"ready": bool(value)}}])
        assert convert("EndpointSlice", sl).endpoints[0].ready is bool(value)   # (True/False,) remembered
        with pytest.raises(InvalidObject, match="conditions.ready: expected a boolean"):
            convert("EndpointSlice", with_(sl, ["endpoints", 0, "conditions"], {"ready": value}))


@pytest.mark.parametrize("field,value", [("name", 0), ("name", False), ("name", []),
                                         ("namespace", 0), ("namespace", False)])
@pytest.mark.parametrize("atype,address", [("IPv4", "10.0.0.1"), ("IPv6", "fd00::1")])
def test_a_falsy_non_string_in_a_pod_target_ref_is_invalid(field, value, atype, address):
    ref = {"kind": "Pod", "name": "web-0", field: value}
    sl = with_(with_(SLICE, ["addressType"], atype), ["endpoints"], [{"addresses": [address], "targetRef": ref}])
    with pytest.raises(InvalidObject, match=f"targetRef.{field}: expected string"):
        convert("EndpointSlice", sl)


def test_every_service_field_lands_in_its_own_record_field():
    """service_from_dict builds the record positionally: each field set to a value of its own."""
    from clusterdns.model import Service, ServicePort
    obj = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "lb", "namespace": "shop",
                        "labels": {"service.kubernetes.io/service-proxy-name": "mine", "app": "x"},
                        "annotations": {"service.kubernetes.io/topology-mode": "Auto"}},
           "spec": {"type": "LoadBalancer", "clusterIPs": ["10.96.0.9"], "externalIPs": ["192.0.2.1"],
                    "ports": [{"name": "http", "port": 80, "nodePort": 30080, "targetPort": "web"}],
                    "loadBalancerSourceRanges": ["203.0.113.0/24"], "sessionAffinity": "ClientIP",
                    "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
                    "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                    "healthCheckNodePort": 31000},
           "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.7"}]}}}
    assert convert("Service", obj) == Service(
        namespace="shop", name="lb", type="LoadBalancer", cluster_ips=("10.96.0.9",), headless=False,
        external_name="", ports=(ServicePort("http", "TCP", 80, 30080, "web"),), external_ips=("192.0.2.1",),
        lb_ips=("198.51.100.7",), lb_source_ranges=("203.0.113.0/24",), affinity_timeout=60,
        external_local=True, internal_local=True, health_check_node_port=31000, topology_aware=True,
        proxy_name="mine", labels=(("app", "x"), ("service.kubernetes.io/service-proxy-name", "mine")))
    headless = convert("Service", with_(obj, ["spec"], {"clusterIP": "None"}))
    assert (headless.type, headless.headless, headless.cluster_ips) == ("ClusterIP", True, ())
    # the three flags apart: each alone True, so a swap of two of them in the call shows
    plain = with_(with_(with_(obj, ["metadata", "annotations"], {}), ["spec", "externalTrafficPolicy"], "Cluster"),
                  ["spec", "internalTrafficPolicy"], "Cluster")
    for path, value, want in ((["spec", "externalTrafficPolicy"], "Local", (True, False, False)),
                              (["spec", "internalTrafficPolicy"], "Local", (False, True, False)),
                              (["metadata", "annotations"], {"service.kubernetes.io/topology-mode": "Auto"},
                               (False, False, True))):
        svc = convert("Service", with_(plain, path, value))
        assert (svc.external_local, svc.internal_local, svc.topology_aware) == want


@pytest.mark.parametrize("path,value,message", [
    (["spec"], [], "spec: expected mapping, got list"),
    (["spec", "type"], 7, "spec.type: expected string, got int 7"),
    (["spec", "clusterIPs"], "10.96.0.5", "spec.clusterIPs: expected list, got str"),
    (["spec", "ports"], {"port": 80}, "spec.ports: expected list, got dict"),
    (["spec", "healthCheckNodePort"], True, "spec.healthCheckNodePort: port must be an integer, got True"),
    (["spec", "healthCheckNodePort"], None, "spec.healthCheckNodePort: port must be an integer, got None"),
    (["spec", "healthCheckNodePort"], 70000, "spec.healthCheckNodePort: port 70000 out of range"),
])
def test_service_spec_fields_of_another_type_take_the_checked_path(path, value, message):
    """The usual types are read inline; anything else goes through _get / _port_number and their messages."""
    with pytest.raises(InvalidObject, match=re.escape(message)):
        convert("Service", with_(SERVICE, path, value))


@pytest.mark.parametrize("path", [["spec"], ["spec", "type"], ["spec", "ports"], ["spec", "clusterIPs"]])
def test_null_service_spec_fields_take_their_defaults(path):
    svc = convert("Service", with_(SERVICE, path, None))
    assert svc.type == "ClusterIP" and svc.health_check_node_port == 0
