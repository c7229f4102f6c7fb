"""How the two node groups look to Kubernetes: labels, the GPU taint and its toleration.

The node groups apply these, the Helm values and the RayCluster select and tolerate them, so they are
defined once here. Pure data: no Pulumi.
"""

from __future__ import annotations

SYSTEM_NODE_LABELS = {"role": "system"}
"""On the system nodes: the KubeRay operator and the Ray head select it."""

GPU_NODE_LABELS = {"role": "gpu", "nvidia.com/gpu.present": "true"}
"""On GPU nodes. `nvidia.com/gpu.present` is what the nvidia-device-plugin DaemonSet's node affinity
matches when node-feature-discovery is not installed; without it the plugin lands on zero nodes."""

GPU_TAINT_KEY = "nvidia.com/gpu"
GPU_TAINT_VALUE = "true"
GPU_TAINT_EFFECT = "NoSchedule"
"""Keeps everything that does not ask for GPUs off the GPU nodes."""

EKS_TAINT_EFFECTS = {"NoSchedule": "NO_SCHEDULE", "NoExecute": "NO_EXECUTE",
                     "PreferNoSchedule": "PREFER_NO_SCHEDULE"}
"""The EKS API spells taint effects differently from Kubernetes."""

GPU_AMI_TYPE = "AL2023_x86_64_NVIDIA"
SYSTEM_AMI_TYPE = "AL2023_x86_64_STANDARD"
SYSTEM_ROOT_VOLUME_GIB = 100
"""A system node pulls the Ray head image (the same DLC image as the workers, tens of GB)."""


def gpu_toleration() -> dict[str, str]:
    """The toleration, as a Kubernetes object, for the GPU taint."""
    return {"key": GPU_TAINT_KEY, "operator": "Equal", "value": GPU_TAINT_VALUE,
            "effect": GPU_TAINT_EFFECT}
