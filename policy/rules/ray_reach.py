"""Who reaches the Ray pods: no Service or Ingress puts them outside the cluster, whatever selector or
name it uses, and a NetworkPolicy admits only what the Ray pods need.

Ray's dashboard and Jobs API run whatever code they are sent, and its GCS, raylet and metrics ports
are not all guarded by Ray's token: the pods stay reachable from inside the cluster only, and there
only from what a NetworkPolicy admits (infra/network_policy.py).
"""

from __future__ import annotations

import ipaddress
from typing import Any, Mapping, Sequence

from .api_endpoint import beyond_limits, without
from .ray_namespace import (RayPod, has_unknown, head_service_name, label_selector_matches, namespace_of,
                            ray_pods_of, service_selects)
from .ray_pods import service_exposure_violations
from .resources import (INGRESS, NETWORK_POLICY, RAY_CLUSTER, SERVICE, UNKNOWN, StackResource, StackViolation,
                        as_list, value_at)

_WHY_NOT_EXPOSED = ("Ray's dashboard and Jobs API run whatever code they are sent, so they stay inside the "
                    "cluster and are reached through kubectl port-forward (python -m workloads submit does)")


def _roles(pods: Sequence[RayPod]) -> str:
    return ", ".join(dict.fromkeys(f"{p.cluster_name} {p.role}" for p in pods))


def _outside_the_cluster(service: Mapping[str, Any]) -> str | None:
    """How a Service takes traffic from outside the cluster, None when it does not (or cannot be told yet)."""
    kind = value_at(service, "spec", "type")
    if kind in ("LoadBalancer", "NodePort"):
        return f"is of type {kind!r}"
    external = value_at(service, "spec", "externalIPs")
    if external is not UNKNOWN and as_list(external):
        return f"takes traffic for externalIPs {', '.join(map(str, as_list(external)))} on every node"
    return None


def _selected_pods(service: StackResource, pods: Sequence[RayPod]) -> list[RayPod]:
    namespace, selector = namespace_of(service.props), value_at(service.props, "spec", "selector")
    if namespace is UNKNOWN or has_unknown(selector):
        return []
    return [p for p in pods if p.namespace == namespace and service_selects(selector, p.labels)]


def _ingress_backends(ingress: Mapping[str, Any]) -> list[Any]:
    """The Service names an Ingress (networking.k8s.io/v1) routes to: its default backend and each path's."""
    spec = value_at(ingress, "spec")
    backends = [value_at(spec, "defaultBackend")]
    for rule in as_list(value_at(spec, "rules")):
        backends += [value_at(path, "backend") for path in as_list(value_at(rule, "http", "paths"))]
    return [value_at(b, "service", "name") for b in backends if b is not None]


def ray_exposure_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """No Service whose selector picks Ray pods (by any of their labels, whatever its name) takes
    traffic from outside the cluster, and no Ingress routes to such a Service or to the head Service
    KubeRay creates. A Service the resource rule `service_exposure_violations` already refuses (a
    `ray.io/*` selector) is left to it."""
    pods = ray_pods_of(resources)
    services = [r for r in resources if r.type == SERVICE]
    out: list[StackViolation] = []
    for service in services:
        selected = _selected_pods(service, pods)
        how = _outside_the_cluster(service.props) if selected else None
        if how and not service_exposure_violations(service.props):
            name = value_at(service.props, "metadata", "name")
            out.append(StackViolation(service.urn, f"Service {name} selects the Ray pods ({_roles(selected)}) "
                                      f"and {how}: {_WHY_NOT_EXPOSED}"))
    head_services = {(p.namespace, head_service_name(rc.props)): p.cluster_name
                     for rc in resources if rc.type == RAY_CLUSTER for p in pods if p.cluster_urn == rc.urn}
    for ingress in (r for r in resources if r.type == INGRESS):
        namespace = namespace_of(ingress.props)
        for backend in _ingress_backends(ingress.props):
            if not isinstance(backend, str) or not isinstance(namespace, str):
                continue
            if (namespace, backend) in head_services:
                reached = f"KubeRay's head service {backend} of RayCluster {head_services[(namespace, backend)]}"
            else:
                named = [s for s in services if value_at(s.props, "metadata", "name") == backend
                         and namespace_of(s.props) == namespace]
                selected = [p for s in named for p in _selected_pods(s, pods)]
                if not selected:
                    continue
                reached = f"Service {backend}, which selects the Ray pods ({_roles(selected)})"
            out.append(StackViolation(ingress.urn, f"Ingress routes to {reached}: {_WHY_NOT_EXPOSED}"))
    return out


def _guards(policy: Mapping[str, Any], pod: RayPod) -> Any:
    """True when the NetworkPolicy selects the pod for its Ingress rules, False when not, UNKNOWN when
    that cannot be told yet."""
    selector, types = value_at(policy, "spec", "podSelector"), value_at(policy, "spec", "policyTypes")
    if namespace_of(policy) is UNKNOWN or has_unknown(selector) or has_unknown(types):
        return UNKNOWN
    # Kubernetes: unset policyTypes means Ingress (and Egress when there are egress rules).
    ingress_type = types is None or "Ingress" in as_list(types)
    return ingress_type and namespace_of(policy) == pod.namespace and label_selector_matches(selector, pod.labels)


def _admits_too_much(rule: Any) -> str | None:
    """What an ingress rule admits that no Ray pod needs, None when it is narrow enough (or unknown)."""
    peers = value_at(rule, "from")
    if rule is UNKNOWN or peers is UNKNOWN:
        return None
    if not as_list(peers):  # Kubernetes: no `from` matches all sources
        return "every source"
    networks, shown = [], []
    for peer in as_list(peers):
        namespaces, pods, block = (value_at(peer, k) for k in ("namespaceSelector", "podSelector", "ipBlock"))
        if has_unknown(peer):
            continue
        if namespaces is not None and label_selector_matches(namespaces, {}) and \
                label_selector_matches(pods, {}) and not value_at(namespaces, "matchExpressions"):
            return "every pod of every namespace"
        if isinstance(block, Mapping) and isinstance(block.get("cidr"), str):
            try:
                network = ipaddress.ip_network(block["cidr"].strip(), strict=False)
            except ValueError:
                continue
            shown.append(block["cidr"])
            networks += without(network, as_list(block.get("except")))
    wide = beyond_limits(shown, networks)
    return "; ".join(wide) if wide else None


def ray_network_policy_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """Every Ray pod is selected by a NetworkPolicy with Ingress rules (otherwise every pod of the
    cluster reaches it), and no policy that selects a Ray pod admits every source, every pod of every
    namespace, or more addresses than an allow-list may open (api_endpoint.OPEN_ADDRESS_LIMITS):
    NetworkPolicies add up, so one such rule opens the pods whatever the others say."""
    pods = ray_pods_of(resources)
    policies = [r for r in resources if r.type == NETWORK_POLICY]
    out: list[StackViolation] = []
    for pod in pods:
        guarded = [_guards(p.props, pod) for p in policies]
        if UNKNOWN not in guarded and not any(guarded):
            out.append(StackViolation(pod.cluster_urn, f"the Ray {pod.role} pods are selected by no NetworkPolicy "
                                      f"with Ingress rules: every pod of the cluster can connect to Ray's GCS, "
                                      f"dashboard, Jobs API and metrics ports (namespace {pod.namespace}; "
                                      "infra/network_policy.py is the program's)"))
    for policy in policies:
        if not any(_guards(policy.props, pod) is True for pod in pods):
            continue
        for i, rule in enumerate(as_list(value_at(policy.props, "spec", "ingress"))):
            too_much = _admits_too_much(rule)
            if too_much:
                out.append(StackViolation(policy.urn, f"ingress rule {i} admits {too_much} to the Ray pods: "
                                          "only the Ray pods and the KubeRay operator need to reach them"))
    return out
