"""The two managed node groups: one system node (KubeRay operator, Ray head) and the EFA GPU nodes
in one AZ and one cluster placement group."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

import pulumi
import pulumi_aws as aws
import pulumi_eks as eks

from infra.health import enable_node_auto_repair
from infra.nodes import (EKS_TAINT_EFFECTS, GPU_AMI_TYPE, GPU_NODE_LABELS, GPU_TAINT_EFFECT,
                         GPU_TAINT_KEY, GPU_TAINT_VALUE, SYSTEM_AMI_TYPE, SYSTEM_NODE_LABELS,
                         SYSTEM_ROOT_VOLUME_GIB)

NODE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy",
                 "AmazonEC2ContainerRegistryReadOnly")


def _node_role(name: str, parent: pulumi.Resource) -> aws.iam.Role:
    """The EC2 role of a node group; EKS creates its access entry (API authentication mode)."""
    child = pulumi.ResourceOptions(parent=parent)
    role = aws.iam.Role(f"{name}-role", assume_role_policy=json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                       "Principal": {"Service": "ec2.amazonaws.com"}}],
    }), opts=child)
    partition = aws.get_partition_output(opts=pulumi.InvokeOptions(parent=parent)).partition
    for policy in NODE_POLICIES:
        aws.iam.RolePolicyAttachment(
            f"{name}-{policy}", role=role.name,
            policy_arn=pulumi.Output.concat("arn:", partition, ":iam::aws:policy/", policy),
            opts=child)
    return role


@dataclass(frozen=True, kw_only=True)
class SystemNodeGroupArgs:
    cluster: eks.Cluster
    instance_type: str
    subnet_ids: Sequence[pulumi.Input[str]]
    """Private subnets; the node may land in any of their AZs."""


class SystemNodeGroup(pulumi.ComponentResource):
    """One non-GPU node labelled role=system."""

    def __init__(self, name: str, args: SystemNodeGroupArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:SystemNodeGroup", name, None, opts)
        role = _node_role(name, self)
        self.node_group = eks.ManagedNodeGroup(
            f"{name}-nodes",
            cluster=args.cluster,
            node_role=role,
            ami_type=SYSTEM_AMI_TYPE,
            instance_types=[args.instance_type],
            capacity_type="ON_DEMAND",
            subnet_ids=list(args.subnet_ids),
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(desired_size=1, min_size=1,
                                                              max_size=1),
            labels=dict(SYSTEM_NODE_LABELS),
            disk_size=SYSTEM_ROOT_VOLUME_GIB,
            opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({})


@dataclass(frozen=True, kw_only=True)
class GpuNodeGroupArgs:
    cluster: eks.Cluster
    instance_type: str
    node_count: int
    """desired = min = max: the training job's world size is fixed."""
    availability_zone: str
    """AZ of the cluster placement group; all nodes land here."""
    subnet_id: pulumi.Input[str]
    """The private subnet in `availability_zone` (the only subnet of the group)."""
    root_volume_gib: int


class GpuNodeGroup(pulumi.ComponentResource):
    """EFA-enabled GPU nodes on the EKS NVIDIA AMI, tainted so only GPU pods land there."""

    def __init__(self, name: str, args: GpuNodeGroupArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:GpuNodeGroup", name, None, opts)
        role = _node_role(name, self)
        n = args.node_count
        self.node_group = eks.ManagedNodeGroup(
            f"{name}-nodes",
            cluster=args.cluster,
            node_role=role,
            ami_type=GPU_AMI_TYPE,
            instance_types=[args.instance_type],
            capacity_type="ON_DEMAND",
            # pulumi-eks adds the instance's EFA interfaces to the launch template and creates a
            # cluster placement group in this AZ.
            enable_efa_support=True,
            placement_group_availability_zone=args.availability_zone,
            subnet_ids=[args.subnet_id],
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(desired_size=n, min_size=n,
                                                              max_size=n),
            labels=dict(GPU_NODE_LABELS),
            taints=[aws.eks.NodeGroupTaintArgs(key=GPU_TAINT_KEY, value=GPU_TAINT_VALUE,
                                               effect=EKS_TAINT_EFFECTS[GPU_TAINT_EFFECT])],
            disk_size=args.root_volume_gib,
            # Replaces a node that the monitoring agent reports unhealthy (infra/health.py).
            opts=pulumi.ResourceOptions(parent=self, transforms=[enable_node_auto_repair]))
        self.register_outputs({})
