"""Ray's pods: Guaranteed worker containers with the EFA request, and the head never exposed."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping

from .resources import UNKNOWN, as_list, pod_containers, value_at

EFA_RESOURCE = "vpc.amazonaws.com/efa"
ALLOWED_SERVICE_TYPES = (None, "ClusterIP")
_RAY_POD_LABELS = {("app.kubernetes.io/created-by", "kuberay-operator"),
                   ("app.kubernetes.io/name", "kuberay")}
_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIX = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
                   "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)$")


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes resource quantity ("4", 4, "500m", "180Gi", "1e3") as a number."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    m = _QUANTITY_RE.match(text)
    if not m:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
    suffix = m.group(2)
    return number * (_BINARY_SUFFIX.get(suffix) or _DECIMAL_SUFFIX[suffix])


def _requests_equal_limits(where: str, container: Mapping[str, Any]) -> list[str]:
    requests = value_at(container, "resources", "requests")
    limits = value_at(container, "resources", "limits")
    if UNKNOWN in (requests, limits):
        return []
    if not requests or not limits:
        return [f"{where}: sets no resource requests and limits; requests must equal limits "
                "(Guaranteed QoS) so one throttled rank cannot stall the others"]
    out: list[str] = []
    for name in sorted(set(requests) | set(limits)):
        req, lim = requests.get(name), limits.get(name)
        if UNKNOWN in (req, lim):
            continue
        if req is None or lim is None:
            side = "requests" if req is None else "limits"
            out.append(f"{where}: {name} is missing from {side}; requests must equal limits")
            continue
        try:
            equal = parse_quantity(req) == parse_quantity(lim)
        except ValueError as exc:
            out.append(f"{where}: {name}: {exc}")
            continue
        if not equal:
            out.append(f"{where}: {name} request {req} != limit {lim}; requests must equal limits")
    return out


def ray_worker_violations(props: Mapping[str, Any]) -> list[str]:
    """Requests == limits on every worker container, and the EFA request on the Ray container."""
    groups = value_at(props, "spec", "workerGroupSpecs")
    if groups is UNKNOWN:
        return []
    if not as_list(groups):
        return ["RayCluster has no worker group"]
    out: list[str] = []
    for i, group in enumerate(as_list(groups)):
        gname = value_at(group, "groupName")
        label = f"worker group {gname if isinstance(gname, str) else i}"
        pod_spec = value_at(group, "template", "spec")
        containers = as_list(value_at(pod_spec, "containers"))
        if pod_spec is UNKNOWN or value_at(pod_spec, "containers") is UNKNOWN:
            continue
        if not containers:
            out.append(f"{label}: pod template has no containers")
            continue
        for name, container in pod_containers(pod_spec):
            out.extend(_requests_equal_limits(f"{label}, container {name}", container))
        # KubeRay runs Ray in the first container of the pod.
        ray = containers[0]
        efa = value_at(ray, "resources", "requests", EFA_RESOURCE)
        if efa is UNKNOWN:
            continue
        try:
            efa_count = parse_quantity(efa) if efa is not None else Decimal(0)
        except ValueError as exc:
            out.append(f"{label}: {EFA_RESOURCE}: {exc}")
            continue
        if efa_count < 1:
            out.append(f"{label}: the Ray container requests no {EFA_RESOURCE}; without it the "
                       "EFA device is not mounted and NCCL silently uses TCP sockets")
    return out


def _service_type_violation(where: str, service_type: Any) -> list[str]:
    if service_type is UNKNOWN or service_type in ALLOWED_SERVICE_TYPES:
        return []
    return [f"{where} is {service_type!r}: Ray's dashboard and Jobs API run arbitrary code, so "
            "they stay ClusterIP and are reached through kubectl port-forward"]


def ray_head_exposure_violations(props: Mapping[str, Any]) -> list[str]:
    """The head service stays ClusterIP and no ingress is put in front of it."""
    head = value_at(props, "spec", "headGroupSpec")
    out = _service_type_violation("RayCluster head serviceType", value_at(head, "serviceType"))
    out += _service_type_violation("RayCluster headService spec.type",
                                   value_at(head, "headService", "spec", "type"))
    if value_at(head, "enableIngress") is True:
        out.append("RayCluster head has enableIngress: true; nothing may be exposed in front of "
                   "Ray")
    return out


def selects_ray_pods(selector: Any) -> bool:
    """Whether a Service selector matches pods KubeRay creates (labels ray.io/*)."""
    if not isinstance(selector, Mapping):
        return False
    return any(isinstance(k, str) and k.startswith("ray.io/") for k in selector) or any(
        (k, v) in _RAY_POD_LABELS for k, v in selector.items())


def service_exposure_violations(props: Mapping[str, Any]) -> list[str]:
    """A Service selecting Ray pods (by KubeRay's labels) is ClusterIP, without externalIPs."""
    if not selects_ray_pods(value_at(props, "spec", "selector")):
        return []
    out = _service_type_violation("Service selecting Ray pods has type", value_at(props, "spec", "type"))
    external = value_at(props, "spec", "externalIPs")
    if not out and external is not UNKNOWN and as_list(external):
        out.append(f"Service selecting Ray pods takes traffic for externalIPs {', '.join(map(str, as_list(external)))} "
                   "on every node: Ray's dashboard and Jobs API run arbitrary code, so they stay inside the "
                   "cluster and are reached through kubectl port-forward")
    return out
