"""The Ray namespace enforces a Pod Security Standard: at least `baseline`.

Ray runs whatever code its jobs are sent, inside its pods. Without an enforced standard a pod in its
namespace may run privileged, share the node's network or PID namespace, or mount the node's disk:
a job, or anyone holding the Ray token, would then own the node. `baseline` refuses all of these;
`restricted` refuses more (infra/raycluster.py says why the program enforces baseline).
"""

from __future__ import annotations

from typing import Sequence

from .ray_namespace import namespace_of
from .resources import NAMESPACE, RAY_CLUSTER, UNKNOWN, StackResource, StackViolation, value_at

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
ENFORCED_LEVELS = ("baseline", "restricted")
"""The Pod Security Standards that keep a pod off its node's privileges."""


def ray_pod_security_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """The namespace of every RayCluster is declared by the stack and labelled to enforce
    ENFORCED_LEVELS."""
    namespaces = [r for r in resources if r.type == NAMESPACE]
    names = [value_at(n.props, "metadata", "name") for n in namespaces]
    out: list[StackViolation] = []
    for rc in (r for r in resources if r.type == RAY_CLUSTER):
        wanted = namespace_of(rc.props)
        if wanted is UNKNOWN:
            continue
        declared = [n for n, name in zip(namespaces, names) if name == wanted]
        if not declared:
            if UNKNOWN not in names:
                out.append(StackViolation(rc.urn, f"the Ray namespace {wanted} is not declared by this stack, so its "
                                          "Pod Security labels cannot be checked: declare it (a "
                                          f"kubernetes:core/v1:Namespace) with {ENFORCE_LABEL}: baseline"))
            continue
        for namespace in declared:
            labels = value_at(namespace.props, "metadata", "labels")
            level = value_at(labels, ENFORCE_LABEL)
            if labels is UNKNOWN or level is UNKNOWN or level in ENFORCED_LEVELS:
                continue
            what = f"enforces {level!r}" if level else f"enforces no Pod Security Standard (no {ENFORCE_LABEL} label)"
            out.append(StackViolation(namespace.urn, f"the Ray namespace {wanted} {what}: a pod there may run "
                                      "privileged, in the node's network or PID namespace, or mount the node's "
                                      f"disk, and Ray runs whatever code it is sent; set {ENFORCE_LABEL} to "
                                      "baseline (what the Ray pods meet) or restricted"))
    return out
