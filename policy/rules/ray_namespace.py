"""Which pods are Ray's, and which Kubernetes selectors pick them.

A RayCluster's pods carry the labels of their template, then KubeRay's own (v1.7.0, `labelPod` in
ray-operator/controllers/ray/common/pod.go): the template may override all of KubeRay's but
`ray.io/node-type`, `ray.io/group` and `ray.io/cluster`. Whatever reaches a pod with those labels
in the RayCluster's namespace reaches Ray, whatever it is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .resources import RAY_CLUSTER, UNKNOWN, StackResource, as_list, value_at

KUBERAY_FIXED_LABELS = ("ray.io/node-type", "ray.io/group", "ray.io/cluster")
"""The labels KubeRay sets on a Ray pod whatever its template says."""
DEFAULT_NAMESPACE = "default"
"""Where Kubernetes puts an object whose metadata names no namespace."""


@dataclass(frozen=True, kw_only=True)
class RayPod:
    """One kind of pod a RayCluster runs: its head, or one worker group's workers."""

    cluster_urn: str
    """The RayCluster's URN: violations about its pods are reported against it."""
    cluster_name: str
    """metadata.name of the RayCluster."""
    namespace: str
    """The namespace the pods run in (the RayCluster's)."""
    role: str
    """`head`, or `worker group <name>`."""
    labels: Mapping[str, str]
    """Every label the pods carry."""


def namespace_of(props: Mapping[str, Any]) -> Any:
    """metadata.namespace of a namespaced object (DEFAULT_NAMESPACE when unset, UNKNOWN when not
    known yet)."""
    namespace = value_at(props, "metadata", "namespace")
    return DEFAULT_NAMESPACE if namespace in (None, "") else namespace


def _kuberay_labels(template: Any, *, cluster: str, node_type: str, group: str) -> dict[str, str] | None:
    own = value_at(template, "metadata", "labels")
    if own is UNKNOWN or (isinstance(own, Mapping) and UNKNOWN in own.values()):
        return None
    labels = {"ray.io/is-ray-node": "yes", "ray.io/identifier": f"{cluster}-{node_type}",
              "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
    labels.update({k: v for k, v in (own or {}).items() if k not in KUBERAY_FIXED_LABELS})
    labels.update({"ray.io/cluster": cluster, "ray.io/node-type": node_type, "ray.io/group": group})
    return labels


def ray_pods_of(resources: Sequence[StackResource]) -> list[RayPod]:
    """The head and each worker group of every RayCluster of the stack whose name, namespace and pod
    labels are known."""
    out: list[RayPod] = []
    for rc in (r for r in resources if r.type == RAY_CLUSTER):
        name, namespace = value_at(rc.props, "metadata", "name"), namespace_of(rc.props)
        if not isinstance(name, str) or not isinstance(namespace, str):
            continue
        kinds = [("head", "head", "headgroup", value_at(rc.props, "spec", "headGroupSpec", "template"))]
        for group in as_list(value_at(rc.props, "spec", "workerGroupSpecs")):
            group_name = value_at(group, "groupName")
            if isinstance(group_name, str):
                kinds.append((f"worker group {group_name}", "worker", group_name, value_at(group, "template")))
        for role, node_type, group_name, template in kinds:
            labels = _kuberay_labels(template, cluster=name, node_type=node_type, group=group_name)
            if labels is not None:
                out.append(RayPod(cluster_urn=rc.urn, cluster_name=name, namespace=namespace, role=role,
                                  labels=labels))
    return out


def head_service_name(raycluster: Mapping[str, Any]) -> Any:
    """The Service KubeRay creates in front of the head (`<name>-head-svc`, unless the RayCluster's
    headService names it)."""
    named = value_at(raycluster, "spec", "headGroupSpec", "headService", "metadata", "name")
    name = value_at(raycluster, "metadata", "name")
    if named not in (None, ""):
        return named
    return f"{name}-head-svc" if isinstance(name, str) else UNKNOWN


def service_selects(selector: Any, labels: Mapping[str, str]) -> bool:
    """Whether a Service's selector (a plain label map; empty selects no pod) picks pods with `labels`."""
    if not isinstance(selector, Mapping) or not selector:
        return False
    return all(labels.get(k) == v for k, v in selector.items())


def label_selector_matches(selector: Any, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels and matchExpressions; empty selects everything) picks
    an object with `labels`."""
    if selector is None:
        selector = {}
    match_labels = value_at(selector, "matchLabels") or {}
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expression in as_list(value_at(selector, "matchExpressions")):
        key, operator = value_at(expression, "key"), value_at(expression, "operator")
        values = as_list(value_at(expression, "values"))
        present = key in labels
        if not {"In": present and labels.get(key) in values,
                "NotIn": not present or labels.get(key) not in values,
                "Exists": present, "DoesNotExist": not present}.get(operator, False):
            return False
    return True


def has_unknown(value: Any) -> bool:
    """Whether UNKNOWN is anywhere inside `value`."""
    if value is UNKNOWN:
        return True
    if isinstance(value, Mapping):
        return any(has_unknown(v) for v in value.values())
    if isinstance(value, Sequence) and not isinstance(value, str):
        return any(has_unknown(v) for v in value)
    return False
