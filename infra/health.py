"""Bad GPUs and EFA devices: the EKS node monitoring agent and the GPU node group's auto repair.

The agent (the `eks-node-monitoring-agent` EKS add-on, a DaemonSet on every node) reads each node's
kernel log, GPUs (NVIDIA XID errors and DCGM health, through its `dcgm-server` DaemonSet) and network
interfaces, EFA included, and reports them as node conditions: AcceleratedHardwareReady,
NetworkingReady, KernelReady, StorageReady, ContainerRuntimeReady. Node auto repair of a managed node
group acts on those conditions (and on NotReady): it reboots or replaces a node that stays unhealthy.
A replaced GPU node is a lost node to the training run, which waits for it and resumes from its
latest checkpoint in S3 (workloads/launch/ray_train.py, WorkerGroupWait).

What the pinned providers offer: pulumi-aws 7.51.1 declares any EKS add-on (`aws.eks.Addon`) and a
node group's `node_repair_config` (`aws.eks.NodeGroup`). pulumi-eks 4.4.0's `ManagedNodeGroup`, which
builds the GPU node group's EFA launch template and cluster placement group, does not expose
`nodeRepairConfig` (pulumi/pulumi-eks issue 1640); `enable_node_auto_repair` sets it with a Pulumi
transform on the `aws:eks/nodeGroup:NodeGroup` that the component creates (transforms reach the
children of packaged components).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_aws as aws

from infra.nodes import gpu_toleration

NODE_MONITORING_AGENT = "eks-node-monitoring-agent"
NODE_GROUP_TYPE = "aws:eks/nodeGroup:NodeGroup"
"""The resource inside pulumi-eks's ManagedNodeGroup that holds the node group's settings."""


def node_monitoring_agent_values() -> dict[str, Any]:
    """The add-on's configuration values. The agent tolerates every taint, but its `dcgm-server`
    DaemonSet, which reads the GPUs' health, ships with no toleration: on GPU nodes tainted
    `nvidia.com/gpu` it would land nowhere, and GPU faults would go unreported exactly where they
    happen."""
    return {"dcgmAgent": {"tolerations": [gpu_toleration()]}}


def enable_node_auto_repair(args: pulumi.ResourceTransformArgs) -> Optional[pulumi.ResourceTransformResult]:
    """A transform for a ManagedNodeGroup: turns on node auto repair on the node group it creates."""
    if args.type_ != NODE_GROUP_TYPE:
        return None
    return pulumi.ResourceTransformResult(props={**args.props, "nodeRepairConfig": {"enabled": True}},
                                          opts=args.opts)


@dataclass(frozen=True, kw_only=True)
class NodeHealthArgs:
    cluster_name: pulumi.Input[str]
    version: str
    """The add-on version (stack setting `nodeMonitoringAgentVersion`)."""
    cluster: pulumi.Resource
    """The EKS cluster the add-on is installed in (created after it)."""


class NodeHealth(pulumi.ComponentResource):
    """The EKS node monitoring agent add-on, its GPU health reader allowed onto the GPU nodes."""

    def __init__(self, name: str, args: NodeHealthArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:NodeHealth", name, None, opts)
        self.agent = aws.eks.Addon(
            f"{name}-monitoring-agent", cluster_name=args.cluster_name, addon_name=NODE_MONITORING_AGENT,
            addon_version=args.version,
            configuration_values=json.dumps(node_monitoring_agent_values()),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.cluster]))
        self.register_outputs({})
