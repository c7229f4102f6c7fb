"""Idle GPUs cost nothing (`gpuIdleMinutes`): what the stack sets so that the Ray worker pods and
the GPU nodes go to zero between jobs and come back for the next. Pure data: no Pulumi.

Two autoscalers share the work, each owning one count that Pulumi then leaves alone:

- KubeRay's in-tree Ray autoscaler (a sidecar of the head pod) owns the worker pods: a job's
  resource demand adds pods up to `gpuNodeCount`, and a worker idle for `gpuIdleMinutes` is
  removed, down to none (`minReplicas: 0`). The RayCluster leaves `replicas` unset, so Pulumi's
  server-side apply never owns the field the autoscaler writes.
- The Kubernetes Cluster Autoscaler owns the GPU nodes: a worker pod that fits no node makes it
  raise the GPU Auto Scaling group's desired capacity, and a GPU node left with only DaemonSet
  pods is removed `SCALE_DOWN_UNNEEDED` later. The node group's desired size is in
  `ignore_changes`, so a later `pulumi up` does not set it back.

An empty Auto Scaling group has no node for the Cluster Autoscaler to copy, so the group carries
node-template tags with what a node would offer (GPUs, EFA interfaces, huge pages), its labels
and its taint (`node_template_tags`). The Cluster Autoscaler discovers the GPU group alone, by a
tag of this stack's (`DISCOVERY_TAG_KEY`), and its IAM role may change the size of Auto Scaling
groups with that tag only: EKS tags every managed node group's group with the usual
`k8s.io/cluster-autoscaler/*` keys, the system node group's too, so those keys would let it
touch the nodes that run the head.
"""

from __future__ import annotations

from typing import Any

from infra.config import StackConfig
from infra.nodes import GPU_NODE_LABELS, GPU_TAINT_EFFECT, GPU_TAINT_KEY, GPU_TAINT_VALUE, SYSTEM_NODE_LABELS
from infra.sizing import EFA_RESOURCE, GPU_RESOURCE, HUGEPAGES_RESOURCE

DISCOVERY_TAG_KEY = "ray-eks.io/scale-to-zero"
"""On the GPU node group's Auto Scaling group, valued with the EKS cluster's name: the Cluster
Autoscaler discovers groups by it, and its IAM role may resize only groups that carry it."""
NODE_TEMPLATE_PREFIX = "k8s.io/cluster-autoscaler/node-template"
ACCELERATOR_LABEL = "k8s.amazonaws.com/accelerator"
"""The label the Cluster Autoscaler on AWS reads to treat a new node as a GPU node still starting
its device plugin (rather than one without GPUs, which would make it add another)."""

SAFE_TO_EVICT_ANNOTATION = "cluster-autoscaler.kubernetes.io/safe-to-evict"
"""`"false"` on every Ray pod: the Cluster Autoscaler never removes a node that runs one."""

CLUSTER_AUTOSCALER_NAMESPACE = "kube-system"
CLUSTER_AUTOSCALER_SERVICE_ACCOUNT = "cluster-autoscaler"
CLUSTER_AUTOSCALER_IMAGE_TAGS = {
    "1.32": "v1.32.5",
    "1.33": "v1.33.6",
    "1.34": "v1.34.5",
    "1.35": "v1.35.2",
}
"""The Cluster Autoscaler release for each Kubernetes minor the config accepts. The rule: its minor
is the cluster's (the project supports each Kubernetes minor with its own release line), at the
newest patch promoted to registry.k8s.io (kubernetes/k8s.io PR 8815 promoted 1.32.5, the last of
its line; PR 9760, 2026-07-22, 1.33.6, 1.34.5 and 1.35.2). tests/fixtures/cluster-autoscaler lists
the promoted tags, and a test holds the table to the rule against that list."""
CLUSTER_AUTOSCALER_RESOURCES = {"cpu": "100m", "memory": "600Mi"}
"""The Cluster Autoscaler's pod on a system node (requests = limits; its examples ask 100m/600Mi)."""
SCALE_DOWN_UNNEEDED = "2m"
"""How long a GPU node holds nothing but DaemonSet pods before the Cluster Autoscaler removes it.
Short: the node empties only once Ray's autoscaler has found its worker idle for the whole
`gpuIdleMinutes`."""
RAY_AUTOSCALER_RESOURCES = {"cpu": "500m", "memory": "512Mi"}
"""The Ray autoscaler sidecar of the head pod (KubeRay's default size, requests = limits)."""
RAY_AUTOSCALER_VERSION = "v2"
"""Ray's autoscaler v2: what Ray 2.58 runs on KubeRay anyway (it turns v2 on when KubeRay sets the
node's instance ID and type), named so that the local rehearsal runs the same one."""


def enabled(cfg: StackConfig) -> bool:
    return cfg.gpu_idle_minutes > 0


def cluster_autoscaler_image_tag(kubernetes_version: str) -> str:
    """The Cluster Autoscaler image tag for the cluster's Kubernetes minor (validated config)."""
    return CLUSTER_AUTOSCALER_IMAGE_TAGS[kubernetes_version]


def ray_autoscaler_options(cfg: StackConfig) -> dict[str, Any]:
    """RayCluster `autoscalerOptions`: remove a worker idle for `gpuIdleMinutes`."""
    return {
        "version": RAY_AUTOSCALER_VERSION,
        "idleTimeoutSeconds": cfg.gpu_idle_minutes * 60,
        "upscalingMode": "Default",
        "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": dict(RAY_AUTOSCALER_RESOURCES),
                      "limits": dict(RAY_AUTOSCALER_RESOURCES)},
    }


def accelerator_label(cfg: StackConfig) -> dict[str, str]:
    """The accelerator label the GPU nodes carry when they scale to zero."""
    return {ACCELERATOR_LABEL: f"nvidia-{cfg.gpu_instance.gpu_model.lower()}"}


def node_template_tags(cfg: StackConfig, *, cluster_name: str) -> dict[str, str]:
    """Tags of the GPU Auto Scaling group: its discovery tag, and what one of its nodes offers, is
    labelled and tainted with, for the Cluster Autoscaler to plan a node of an empty group. The
    resources are those a Ray worker requests: a worker that asks for a resource the template
    lacks would never make the group grow."""
    instance = cfg.gpu_instance
    resources = {GPU_RESOURCE: str(instance.gpus), EFA_RESOURCE: str(instance.efa_interfaces)}
    if cfg.gpu_huge_pages_mib:
        resources[HUGEPAGES_RESOURCE] = f"{cfg.gpu_huge_pages_mib}Mi"
    labels = {**GPU_NODE_LABELS, **accelerator_label(cfg)}
    return {
        DISCOVERY_TAG_KEY: cluster_name,
        **{f"{NODE_TEMPLATE_PREFIX}/resources/{name}": value for name, value in resources.items()},
        **{f"{NODE_TEMPLATE_PREFIX}/label/{name}": value for name, value in labels.items()},
        f"{NODE_TEMPLATE_PREFIX}/taint/{GPU_TAINT_KEY}": f"{GPU_TAINT_VALUE}:{GPU_TAINT_EFFECT}",
    }


def cluster_autoscaler_values(cfg: StackConfig, *, cluster_name: str) -> dict[str, Any]:
    """Helm values of the cluster-autoscaler chart: AWS, the GPU group found by its discovery tag,
    the image of the cluster's Kubernetes minor, on a system node, through EKS Pod Identity (no
    keys in the values). A node with a pod that uses local storage (every Ray pod's memory-backed
    /dev/shm) is never scaled down, nor is one with a non-DaemonSet kube-system pod."""
    return {
        "cloudProvider": "aws",
        "awsRegion": cfg.region,
        "autoDiscovery": {"clusterName": cluster_name,
                          "tags": [f"{DISCOVERY_TAG_KEY}={cluster_name}"]},
        "fullnameOverride": "cluster-autoscaler",
        "image": {"tag": cluster_autoscaler_image_tag(cfg.kubernetes_version)},
        "nodeSelector": dict(SYSTEM_NODE_LABELS),
        "rbac": {"serviceAccount": {"create": True, "name": CLUSTER_AUTOSCALER_SERVICE_ACCOUNT}},
        "resources": {"requests": dict(CLUSTER_AUTOSCALER_RESOURCES),
                      "limits": dict(CLUSTER_AUTOSCALER_RESOURCES)},
        "extraArgs": {
            "scale-down-enabled": True,
            "scale-down-unneeded-time": SCALE_DOWN_UNNEEDED,
            "skip-nodes-with-local-storage": True,
            "skip-nodes-with-system-pods": True,
            # How long a GPU instance may take to launch and join before the Cluster Autoscaler
            # gives the launch up: its family's figure (infra/instance_types.py, with its source).
            "max-node-provision-time": f"{cfg.gpu_instance.provision_limit.minutes}m",
            "balance-similar-node-groups": False,
            "write-status-configmap": True,
        },
    }


READ_ACTIONS = ("autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeAutoScalingInstances",
                "autoscaling:DescribeLaunchConfigurations", "autoscaling:DescribeScalingActivities",
                "autoscaling:DescribeTags", "ec2:DescribeImages", "ec2:DescribeInstanceTypes",
                "ec2:DescribeLaunchTemplateVersions", "ec2:GetInstanceTypesFromInstanceRequirements")
"""What the Cluster Autoscaler reads (its AWS README's policy); these take no resource scope."""
SCALE_ACTIONS = ("autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup")


def cluster_autoscaler_policy(*, cluster_name: str, partition: str, region: str) -> dict[str, Any]:
    """The Cluster Autoscaler's IAM policy: it reads Auto Scaling groups and instance types, reads
    this cluster's node groups (for their labels and taints), and resizes or removes instances of
    the Auto Scaling groups that carry this stack's discovery tag only; every statement for the
    Pod Identity session of its own service account in this cluster."""
    principal = {
        "aws:PrincipalTag/eks-cluster-name": cluster_name,
        "aws:PrincipalTag/kubernetes-namespace": CLUSTER_AUTOSCALER_NAMESPACE,
        "aws:PrincipalTag/kubernetes-service-account": CLUSTER_AUTOSCALER_SERVICE_ACCOUNT,
    }
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "Read", "Effect": "Allow", "Action": list(READ_ACTIONS), "Resource": "*",
             "Condition": {"StringEquals": principal}},
            {"Sid": "ReadNodeGroups", "Effect": "Allow", "Action": ["eks:DescribeNodegroup"],
             "Resource": f"arn:{partition}:eks:{region}:*:nodegroup/{cluster_name}/*/*",
             "Condition": {"StringEquals": principal}},
            {"Sid": "ScaleTheGpuGroupOnly", "Effect": "Allow", "Action": list(SCALE_ACTIONS),
             "Resource": "*",
             "Condition": {"StringEquals": {**principal,
                                            f"aws:ResourceTag/{DISCOVERY_TAG_KEY}": cluster_name}}},
        ],
    }


def idle_note(cfg: StackConfig) -> str:
    """Why `pulumi up` waits for no worker pod when the GPU nodes scale to zero."""
    return (f"the GPU nodes scale to zero after {cfg.gpu_idle_minutes} min without a job "
            f"(ray-eks:gpuIdleMinutes): a submitted job brings up to {cfg.gpu_node_count} worker "
            "pods and their nodes back")
