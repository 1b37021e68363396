#!/usr/bin/env python3
"""Reads the gateway's rendered NetworkPolicies and says which pods may reach which port,
as Kubernetes' NetworkPolicy semantics decide (a pod selected by a policy of a type is
isolated for that direction; a connection needs the source's egress and the
destination's ingress to allow it). Fails when what docs/kubernetes.md promises does not
hold. Called by scripts/check-deploy with two files: `kubectl kustomize deploy/gateway`
and `kubectl kustomize deploy/gateway-client`, the latter placed in namespace `shop`.

Whether an `ipBlock` matches traffic to or from a pod (by its pod IP) is left to the
network plugin by the API, so every expectation must hold both ways: with ipBlocks
matching pod IPs, and without."""

import ipaddress
import sys

import yaml


def matches(selector, labels):
    """A LabelSelector against a label map; an empty selector matches everything."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        k, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in values:
            return False
        if op == "NotIn" and labels.get(k) in values:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


class Pod:
    def __init__(self, namespace, labels, ip, ns_labels=None):
        self.namespace = namespace  # None: an address outside the cluster's pods
        self.labels = labels
        self.ns_labels = {"kubernetes.io/metadata.name": namespace, **(ns_labels or {})}
        self.ip = ip

    @property
    def external(self):
        return self.namespace is None

    def __repr__(self):
        return self.ip if self.external else f"{self.namespace}/{self.labels}"


# Whether ipBlocks match pod IPs: the plugin's choice; main() checks both.
IPBLOCK_MATCHES_PODS = False


def peer_matches(peer, policy_ns, other):
    if "ipBlock" in peer:
        if not other.external and not IPBLOCK_MATCHES_PODS:
            return False
        block = peer["ipBlock"]
        addr = ipaddress.ip_address(other.ip)
        net = ipaddress.ip_network(block["cidr"])
        return addr.version == net.version and addr in net and not any(
            addr.version == ipaddress.ip_network(c).version and addr in ipaddress.ip_network(c)
            for c in block.get("except") or [])
    if other.external:
        return False
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_sel is not None:
        if not matches(ns_sel, other.ns_labels):
            return False
    elif other.namespace != policy_ns:
        return False
    return pod_sel is None or matches(pod_sel, other.labels)


def port_matches(ports, port):
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p or p["port"] == port or (p.get("endPort") and p["port"] <= port <= p["endPort"]):
            return True
    return False


def allowed(policies, pod, other, port, direction):
    """Whether `pod` admits traffic from (ingress) or sends it to (egress) `other`."""
    if pod.external:
        return True  # outside the cluster: no policy applies
    key = "ingress" if direction == "Ingress" else "egress"
    peers_key = "from" if direction == "Ingress" else "to"
    selecting = [p for p in policies
                 if p["metadata"]["namespace"] == pod.namespace
                 and matches(p["spec"]["podSelector"], pod.labels)
                 and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if (not peers or any(peer_matches(x, p["metadata"]["namespace"], other) for x in peers)) \
                    and port_matches(rule.get("ports"), port):
                return True
    return False


def reach(policies, src, dst, port):
    return allowed(policies, src, dst, port, "Egress") and allowed(policies, dst, src, port, "Ingress")


def load(path, namespace=None):
    out = []
    for d in yaml.safe_load_all(open(path)):
        if d and d.get("kind") == "NetworkPolicy":
            d["metadata"].setdefault("namespace", namespace or "default")
            out.append(d)
    return out


def main():
    global IPBLOCK_MATCHES_PODS
    policies = load(sys.argv[1]) + load(sys.argv[2], namespace="shop")
    gw_ns = next(p["metadata"]["namespace"] for p in policies if p["metadata"]["name"] == "sluice-gateway")
    gateway = Pod(gw_ns, {"app": "sluice-gateway", "sluice-sidecar": "true"}, "10.244.1.10")
    redis = Pod(gw_ns, {"app": "sluice-redis"}, "10.244.2.11")
    client = Pod("shop", {"app": "orders", "sluice-egress": "true"}, "10.244.3.12")
    unlabelled = Pod("shop", {"app": "cart"}, "10.244.3.13")
    billing = Pod("shop", {"app": "billing"}, "10.244.3.14")
    elsewhere = Pod("team-b", {"app": "search", "sluice-egress": "true"}, "10.244.4.15")
    prometheus = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"}, "10.244.5.16")
    stranger = Pod(gw_ns, {"app": "debug"}, "10.244.1.17")
    dns = Pod("kube-system", {"k8s-app": "kube-dns"}, "10.244.0.2")
    internet = Pod(None, {}, "203.0.113.7")
    internet_v6 = Pod(None, {}, "2606:4700:4700::1111")
    public_resolver = Pod(None, {}, "8.8.8.8")
    node_local_dns = Pod(None, {}, "169.254.20.10")
    metadata = Pod(None, {}, "169.254.169.254")
    private = Pod(None, {}, "10.20.30.40")  # a node, an internal load balancer
    api_server = Pod(None, {}, "172.18.0.2")
    private_v6 = Pod(None, {}, "fd12::7")

    cases = [
        ("a labelled client reaches the proxy port", client, gateway, 3128, True),
        ("a labelled client of another namespace reaches the proxy port", elsewhere, gateway, 3128, True),
        ("an unlabelled pod does not", unlabelled, gateway, 3128, False),
        ("a pod of the gateway's own namespace does not", stranger, gateway, 3128, False),
        ("a labelled client cannot reach the admin port", client, gateway, 9901, False),
        ("Prometheus reaches the admin port", prometheus, gateway, 9901, True),
        ("Prometheus cannot use the proxy", prometheus, gateway, 3128, False),
        ("a labelled client cannot skip the proxy to the internet", client, internet, 443, False),
        ("a labelled client cannot call another pod directly", client, billing, 8080, False),
        ("a labelled client resolves names through cluster DNS", client, dns, 53, True),
        ("a labelled client resolves names through a node-local cache", client, node_local_dns, 53, True),
        ("a labelled client cannot use port 53 anywhere else", client, public_resolver, 53, False),
        ("the gateway reaches the internet on 443", gateway, internet, 443, True),
        ("the gateway reaches the internet on 80", gateway, internet, 80, True),
        ("the gateway reaches the internet over IPv6", gateway, internet_v6, 443, True),
        ("the gateway reaches no other port of the internet", gateway, internet, 25, False),
        ("the gateway resolves names through cluster DNS", gateway, dns, 53, True),
        ("the gateway resolves names through a node-local cache", gateway, node_local_dns, 53, True),
        ("the gateway uses no resolver outside", gateway, public_resolver, 53, False),
        ("the gateway reaches its Redis", gateway, redis, 6379, True),
        ("the gateway cannot reach another pod", gateway, billing, 8080, False),
        ("nor another pod on 443", gateway, billing, 443, False),
        ("nor a private address", gateway, private, 443, False),
        ("nor a private IPv6 address", gateway, private_v6, 443, False),
        ("nor the API server", gateway, api_server, 6443, False),
        ("nor instance metadata", gateway, metadata, 80, False),
        ("no one else reaches Redis", client, redis, 6379, False),
        ("not even a pod beside it", stranger, redis, 6379, False),
        ("Redis reaches nothing", redis, internet, 443, False),
    ]
    failed = 0
    for what, src, dst, port, want in cases:
        got = set()
        for IPBLOCK_MATCHES_PODS in (False, True):
            got.add(reach(policies, src, dst, port))
        ok = got == {want}
        failed += not ok
        said = "allowed" if got == {True} else "denied" if got == {False} else "depends on the plugin"
        print(f"  {'ok' if ok else 'WRONG':5} {what}: {said}")
    if failed:
        sys.exit(f"netpol: {failed} of {len(cases)} reachability expectations do not hold")


if __name__ == "__main__":
    main()
