"""Who may connect to the Ray pods: the Ray namespace's NetworkPolicy, as a plain dict.

The Ray pods listen on the GCS, the dashboard and Jobs API, the Ray client, the raylets, the object
managers, the workers and the metrics exporters; Ray's token guards the Jobs API and the GCS, not
the metrics endpoints nor every internal port. The VPC CNI enforces NetworkPolicy objects once its
network policy agent is on (infra/cluster.py), so ingress to a Ray pod is allowed from the other Ray
pods and the KubeRay operator only; every other pod in the cluster is refused.

What still reaches the pods, by how the agent and the kubelet work:
- the kubelet's HTTP probes (KubeRay probes the dashboard agent's health endpoint over HTTP for Ray
  2.53 and later): the network policy agent allows traffic to and from the pod's own node IP
  whatever the policy says (aws/aws-network-policy-agent, "Ignore policy restrictions against Node
  IP", since VPC CNI v1.15.1);
- `kubectl port-forward`, which `python -m workloads submit --stack` uses: the API server hands the
  stream to the kubelet, whose container runtime opens the connection to the port from inside the
  pod's own network namespace, on its loopback interface. That never crosses the pod's network
  interface, where the policy is enforced, and Kubernetes network policies cannot block a pod's
  localhost in any implementation. So port-forward still needs `pods/portforward` RBAC, which is
  what guards it.
"""

from __future__ import annotations

from typing import Any, Mapping

from infra.helm_values import KUBERAY_OPERATOR

KUBERAY_OPERATOR_POD_LABELS = {"app.kubernetes.io/name": KUBERAY_OPERATOR.name}
"""The operator pod's label in its chart (templates/deployment.yaml: the chart's name, which its
values.yaml pins with nameOverride)."""
POLICY_NAME = "ray-pods-ingress"


def ray_network_policy(*, namespace: str, ray_pod_labels: Mapping[str, str]) -> dict[str, Any]:
    """The NetworkPolicy of the Ray namespace: pods labelled `ray_pod_labels` take connections from
    each other and from the KubeRay operator, on any port, and from nothing else."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": POLICY_NAME, "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": dict(ray_pod_labels)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(ray_pod_labels)}}]},
                {"from": [{"namespaceSelector": {"matchLabels": {
                               "kubernetes.io/metadata.name": KUBERAY_OPERATOR.namespace}},
                           "podSelector": {"matchLabels": dict(KUBERAY_OPERATOR_POD_LABELS)}}]},
            ],
        },
    }
