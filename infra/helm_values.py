"""Helm values of the add-on charts, as plain dicts (tests check every key against the chart's own
values.yaml): the NVIDIA and EFA device plugins and the KubeRay operator, with `gpuIdleMinutes`
the Cluster Autoscaler, and on Spot stacks the AWS Node Termination Handler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.config import StackConfig
from infra.nodes import GPU_NODE_LABELS, SYSTEM_NODE_LABELS, gpu_toleration
from infra.scale_to_zero import CLUSTER_AUTOSCALER_NAMESPACE, cluster_autoscaler_values
from infra.scale_to_zero import enabled as scales_to_zero
from infra.spot import node_termination_handler_values


@dataclass(frozen=True, kw_only=True)
class Chart:
    name: str
    repository: str
    namespace: str


NVIDIA_DEVICE_PLUGIN = Chart(name="nvidia-device-plugin",
                             repository="https://nvidia.github.io/k8s-device-plugin",
                             namespace="kube-system")
EFA_DEVICE_PLUGIN = Chart(name="aws-efa-k8s-device-plugin",
                          repository="https://aws.github.io/eks-charts",
                          namespace="kube-system")
KUBERAY_OPERATOR = Chart(name="kuberay-operator",
                         repository="https://ray-project.github.io/kuberay-helm/",
                         namespace="kuberay-system")
CLUSTER_AUTOSCALER = Chart(name="cluster-autoscaler",
                           repository="https://kubernetes.github.io/autoscaler",
                           namespace=CLUSTER_AUTOSCALER_NAMESPACE)
NODE_TERMINATION_HANDLER = Chart(name="aws-node-termination-handler",
                                 repository="https://aws.github.io/eks-charts",
                                 namespace="kube-system")


def nvidia_device_plugin_values() -> dict[str, Any]:
    """The plugin on GPU nodes only: without node-feature-discovery, the node label is the only
    thing its affinity can match."""
    return {
        "nodeSelector": {"nvidia.com/gpu.present": GPU_NODE_LABELS["nvidia.com/gpu.present"]},
        "tolerations": [gpu_toleration()],
    }


def efa_device_plugin_values(cfg: StackConfig) -> dict[str, Any]:
    """The EFA plugin from this stack's regional EKS registry, tolerating the GPU taint (the chart
    tolerates nothing by default, so it would never run on the GPU nodes)."""
    registry = f"{cfg.eks_image_registry_account}.dkr.ecr.{cfg.region}.{_dns_suffix(cfg.region)}"
    return {
        "image": {"repository": f"{registry}/eks/aws-efa-k8s-device-plugin"},
        "tolerations": [gpu_toleration()],
    }


def kuberay_operator_values() -> dict[str, Any]:
    """The operator on the system nodes."""
    return {"nodeSelector": dict(SYSTEM_NODE_LABELS)}


def chart_values(cfg: StackConfig, *, cluster_name: str) -> dict[str, dict[str, Any]]:
    """Values by chart name, exactly as the Helm releases receive them. `cluster_name` is the EKS
    cluster's (the Cluster Autoscaler finds the GPU group by it)."""
    values = {
        NVIDIA_DEVICE_PLUGIN.name: nvidia_device_plugin_values(),
        EFA_DEVICE_PLUGIN.name: efa_device_plugin_values(cfg),
        KUBERAY_OPERATOR.name: kuberay_operator_values(),
    }
    if scales_to_zero(cfg):
        values[CLUSTER_AUTOSCALER.name] = cluster_autoscaler_values(cfg, cluster_name=cluster_name)
    if cfg.is_spot:
        values[NODE_TERMINATION_HANDLER.name] = node_termination_handler_values()
    return values


def chart_versions(cfg: StackConfig) -> dict[str, str]:
    versions = {
        NVIDIA_DEVICE_PLUGIN.name: cfg.nvidia_device_plugin_chart_version,
        EFA_DEVICE_PLUGIN.name: cfg.efa_device_plugin_chart_version,
        KUBERAY_OPERATOR.name: cfg.kuberay_operator_chart_version,
    }
    if scales_to_zero(cfg):
        versions[CLUSTER_AUTOSCALER.name] = cfg.cluster_autoscaler_chart_version
    if cfg.is_spot:
        versions[NODE_TERMINATION_HANDLER.name] = cfg.node_termination_handler_chart_version
    return versions


def _dns_suffix(region: str) -> str:
    return "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
