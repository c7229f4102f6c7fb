"""The two managed node groups: the system nodes (KubeRay operator, Ray head, CoreDNS) and the EFA
GPU nodes in one AZ and one cluster placement group."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Mapping, Sequence

import pulumi
import pulumi_aws as aws
import pulumi_eks as eks

from infra.health import NODE_GROUP_TYPE, enable_node_auto_repair
from infra.imds import launch_template_metadata_options, restrict_instance_metadata
from infra.nodes import (EKS_TAINT_EFFECTS, GPU_AMI_TYPE, GPU_NODE_LABELS, GPU_TAINT_EFFECT,
                         GPU_TAINT_KEY, GPU_TAINT_VALUE, SYSTEM_AMI_TYPE, SYSTEM_NODE_LABELS,
                         SYSTEM_ROOT_VOLUME_GIB)
from infra.config import GpuReservation, StackConfig, format_utc
from infra.instance_types import INSTANCE_TYPES
from infra.spot import EKS_CAPACITY_TYPE as SPOT_CAPACITY_TYPE
from infra.reservation import (END_ACTION, EKS_CAPACITY_TYPE, START_ACTION, LaunchWindow, ReservationEnded,
                               efa_network_interfaces, launch_window, reservation_launch_options,
                               reservation_update_config)

NODE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryReadOnly")
"""Join the cluster and pull images. The VPC CNI's network-interface writes are not here: its own
service account has them, through Pod Identity (infra/cluster.py)."""


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
    """Private subnets; the nodes may land in any of their AZs."""
    node_count: int
    """desired = min = max; more than one keeps CoreDNS, the operator and the Ray head from
    sharing one node's fate."""
    after: Sequence[pulumi.Resource] = ()
    """What the nodes wait for (the VPC CNI add-on: its pods get their credentials only if its
    Pod Identity association exists before they are admitted)."""


class SystemNodeGroup(pulumi.ComponentResource):
    """Non-GPU nodes labelled role=system."""

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
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(
                desired_size=args.node_count, min_size=args.node_count, max_size=args.node_count),
            labels=dict(SYSTEM_NODE_LABELS),
            disk_size=SYSTEM_ROOT_VOLUME_GIB,
            # A launch template of pulumi-eks's, whose metadata options the transform sets.
            enable_imd_sv2=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.after),
                                        transforms=[restrict_instance_metadata]))
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
    capacity_type: str = "on-demand"
    """`on-demand` or `spot` (the stack's gpuCapacityType; a reservation sets its own)."""
    reservation: GpuReservation | None = None
    """Capacity reservation to launch into: the group then gets its own launch template that
    targets it, and no placement group (infra/reservation.py says why)."""
    window: LaunchWindow | None = None
    """With a reservation: how many nodes to ask for now, and a Capacity Block's scheduled scaling
    (gpu_launch_window)."""
    cluster_name: pulumi.Input[str] = ""
    """Name of the EKS cluster (needed with a reservation: its security group goes on the EFA
    interfaces of the group's own launch template; and to scale to zero)."""
    scale_to_zero: ScaleToZero | None = None
    """With `gpuIdleMinutes`: the group may shrink to no node and the Cluster Autoscaler sets its
    size; None: its size is the stack's."""
    after: Sequence[pulumi.Resource] = ()
    """What the nodes wait for (the VPC CNI add-on, as for the system nodes)."""


@dataclass(frozen=True, kw_only=True)
class ScaleToZero:
    """How the GPU node group scales to zero (infra/scale_to_zero.py)."""

    asg_tags: Mapping[str, str]
    """Tags of the group's Auto Scaling group: the Cluster Autoscaler's discovery tag and the
    node template it plans an empty group's nodes by."""
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    """Node labels beside the GPU labels (the accelerator label)."""


class GpuNodeGroup(pulumi.ComponentResource):
    """EFA-enabled GPU nodes on the EKS NVIDIA AMI, tainted so only GPU pods land there."""

    def __init__(self, name: str, args: GpuNodeGroupArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:GpuNodeGroup", name, None, opts)
        role = _node_role(name, self)
        if args.reservation is not None:
            self.node_group = _reserved_node_group(name, args, role=role, parent=self)
        else:
            self.node_group = _on_demand_node_group(name, args, role=role, parent=self)
        self.autoscaling_group_name = autoscaling_group_name(self.node_group)
        if args.scale_to_zero is not None:
            tag_autoscaling_group(name, tags=args.scale_to_zero.asg_tags,
                                  group_name=self.autoscaling_group_name, parent=self)
        if args.window is not None:
            schedule_capacity_block(name, window=args.window, node_count=args.node_count,
                                    autoscaled=args.scale_to_zero is not None,
                                    group_name=self.autoscaling_group_name, parent=self)
        self.register_outputs({})


def gpu_node_labels(args: GpuNodeGroupArgs) -> dict[str, str]:
    extra = args.scale_to_zero.extra_labels if args.scale_to_zero is not None else {}
    return {**GPU_NODE_LABELS, **extra}


def gpu_scaling_config(args: GpuNodeGroupArgs, *, now: int) -> aws.eks.NodeGroupScalingConfigArgs:
    """The group's size: `now` nodes (the stack's count, or fewer while a Capacity Block has not
    started) between `now` and `node_count`; when it scales to zero, none to start with, between 0
    and `node_count` (the desired size is then the Cluster Autoscaler's, and ignored by Pulumi)."""
    if args.scale_to_zero is not None:
        return aws.eks.NodeGroupScalingConfigArgs(desired_size=0, min_size=0,
                                                  max_size=args.node_count)
    return aws.eks.NodeGroupScalingConfigArgs(desired_size=now, min_size=now,
                                              max_size=args.node_count)


def _on_demand_node_group(name: str, args: GpuNodeGroupArgs, *, role: aws.iam.Role,
                          parent: pulumi.Resource) -> eks.ManagedNodeGroup:
    return eks.ManagedNodeGroup(
            f"{name}-nodes",
            cluster=args.cluster,
            node_role=role,
            ami_type=GPU_AMI_TYPE,
            instance_types=[args.instance_type],
            capacity_type=SPOT_CAPACITY_TYPE[args.capacity_type],
            # pulumi-eks adds the instance's EFA interfaces to the launch template and creates a
            # cluster placement group in this AZ.
            enable_efa_support=True,
            placement_group_availability_zone=args.availability_zone,
            subnet_ids=[args.subnet_id],
            scaling_config=gpu_scaling_config(args, now=args.node_count),
            **_scaling_ownership(args),
            labels=gpu_node_labels(args),
            taints=[aws.eks.NodeGroupTaintArgs(key=GPU_TAINT_KEY, value=GPU_TAINT_VALUE,
                                               effect=EKS_TAINT_EFFECTS[GPU_TAINT_EFFECT])],
            disk_size=args.root_volume_gib,
            enable_imd_sv2=True,
            # Replaces a node that the monitoring agent reports unhealthy (infra/health.py); IMDS
            # out of the pods' reach (infra/imds.py).
            opts=pulumi.ResourceOptions(parent=parent, depends_on=list(args.after),
                                        transforms=[enable_node_auto_repair, restrict_instance_metadata]))


def _scaling_ownership(args: GpuNodeGroupArgs) -> dict[str, bool]:
    """pulumi-eks's `ignore_scaling_changes` puts `scalingConfig.desiredSize` in the node group's
    `ignore_changes` (pulumi-eks nodejs/eks/nodes/nodegroup.ts, createManagedNodeGroup): once the
    Cluster Autoscaler sets the size, `pulumi up` leaves it. Unset without scaling to zero, so
    those stacks declare what they always did."""
    return {"ignore_scaling_changes": True} if args.scale_to_zero is not None else {}


def tag_autoscaling_group(name: str, *, tags: Mapping[str, str], group_name: pulumi.Input[str],
                          parent: pulumi.Resource) -> list[aws.autoscaling.Tag]:
    """Tags on the Auto Scaling group `group_name`, one resource each (EKS does not pass a managed
    node group's tags on to its Auto Scaling group). Not propagated to instances: they are for the
    Cluster Autoscaler."""
    return [aws.autoscaling.Tag(
        f"{name}-asg-{re.sub(r'[^A-Za-z0-9]+', '-', key).strip('-')}",
        autoscaling_group_name=group_name,
        tag=aws.autoscaling.TagTagArgs(key=key, value=value, propagate_at_launch=False),
        opts=pulumi.ResourceOptions(parent=parent)) for key, value in tags.items()]


def schedule_capacity_block(name: str, *, window: LaunchWindow, node_count: int, autoscaled: bool,
                            group_name: pulumi.Input[str], parent: pulumi.Resource
                            ) -> list[aws.autoscaling.Schedule]:
    """The Capacity Block's scheduled actions on the group's Auto Scaling group (infra/reservation.py):
    up to `node_count` at the block's start, unless the Cluster Autoscaler owns the size
    (`autoscaled`: it raises the group for a job); down to zero, and no more, before EC2 reclaims
    the instances, so that neither autoscaler brings a node back for the last minutes."""
    child = pulumi.ResourceOptions(parent=parent)
    actions = []
    if window.scale_up_at is not None and not autoscaled:
        actions.append(aws.autoscaling.Schedule(
            f"{name}-block-start", scheduled_action_name=START_ACTION, autoscaling_group_name=group_name,
            start_time=format_utc(window.scale_up_at), min_size=node_count, max_size=node_count,
            desired_capacity=node_count, opts=child))
    if window.scale_down_at is not None:
        actions.append(aws.autoscaling.Schedule(
            f"{name}-block-end", scheduled_action_name=END_ACTION, autoscaling_group_name=group_name,
            start_time=format_utc(window.scale_down_at), min_size=0, max_size=0, desired_capacity=0,
            opts=child))
    return actions


def autoscaling_group_name(node_group: eks.ManagedNodeGroup) -> pulumi.Output[str]:
    """The Auto Scaling group EKS made for this node group, from the node group's own outputs
    (`resources[0].autoscaling_groups[0].name`; EKS names the group, nothing here can predict it).

    Never looked up by the group's labels: a change of capacity type, instance type, AZ or
    reservation replaces the node group, Pulumi creates the new one before it deletes the old, and
    for that while two groups of the cluster carry the same labels (docs/INFRA.md)."""
    return node_group.node_group.apply(lambda group: group.resources).apply(
        lambda resources: resources[0].autoscaling_groups[0].name)


def gpu_launch_window(cfg: StackConfig) -> LaunchWindow | None:
    """The GPU node group's size now when it targets a reservation (None when it does not);
    pulumi.RunError when the reservation can no longer launch instances. Called before any
    resource is declared, like the config check."""
    if cfg.gpu_reservation is None:
        return None
    try:
        return launch_window(cfg.gpu_reservation, node_count=cfg.gpu_node_count,
                             now=datetime.now(timezone.utc), stack=pulumi.get_stack())
    except ReservationEnded as exc:
        raise pulumi.RunError(f"stack {pulumi.get_stack()}: {exc}") from None


def set_update_config(update_config: dict[str, object]) -> pulumi.ResourceTransform:
    """A transform for a ManagedNodeGroup: sets `update_config` on the node group it creates
    (pulumi-eks 4.4.0's ManagedNodeGroup does not expose it)."""
    def transform(args: pulumi.ResourceTransformArgs) -> pulumi.ResourceTransformResult | None:
        if args.type_ != NODE_GROUP_TYPE:
            return None
        return pulumi.ResourceTransformResult(props={**args.props, "updateConfig": update_config},
                                              opts=args.opts)
    return transform


def _reserved_node_group(name: str, args: GpuNodeGroupArgs, *, role: aws.iam.Role,
                         parent: pulumi.Resource) -> eks.ManagedNodeGroup:
    """The GPU node group inside a capacity reservation, through a launch template of its own:
    pulumi-eks's EFA template has no capacity reservation target and a placement group."""
    reservation, window = args.reservation, args.window
    assert reservation is not None and window is not None and args.cluster_name
    child = pulumi.ResourceOptions(parent=parent)
    if window.note:
        pulumi.log.warn(window.note, resource=parent)
    # Read from EC2, never created or deleted: a reservation ID EC2 does not know fails the
    # preview here. The template waits for the read but targets the stack file's ID and carries
    # its facts as tags: policies see registered resources only, never reads.
    reader = (aws.ec2.CapacityBlockReservation if reservation.is_capacity_block
              else aws.ec2.CapacityReservation)
    target = reader.get(f"{name}-reservation", reservation.reservation_id, opts=child)
    instance = INSTANCE_TYPES[args.instance_type]
    # The security group EKS made for the cluster: managed nodes get it by default, and its
    # self-referencing rule lets EFA traffic flow between the nodes. Looked up once the cluster
    # exists (during the first preview it is not known yet).
    security_group = aws.eks.get_cluster_output(
        name=args.cluster_name,
        opts=pulumi.InvokeOutputOptions(parent=parent, depends_on=[args.cluster]),
    ).vpc_config.cluster_security_group_id
    template = aws.ec2.LaunchTemplate(
        f"{name}-launch-template",
        instance_type=args.instance_type,
        network_interfaces=efa_network_interfaces(instance, [security_group]),
        block_device_mappings=[{"device_name": "/dev/xvda", "ebs": {
            "volume_size": args.root_volume_gib, "volume_type": "gp3",
            "delete_on_termination": "true"}}],
        metadata_options=launch_template_metadata_options(),
        **reservation_launch_options(reservation),
        opts=pulumi.ResourceOptions(parent=parent, depends_on=[target]))
    # An update (a new launch template version, a new AMI) adds nodes before it removes old ones;
    # inside a reservation with no spare instance none could launch and the update would stall.
    # Then it replaces one node at a time, terminating each before launching its replacement.
    transforms = [enable_node_auto_repair]
    update_config = reservation_update_config(reservation, node_count=args.node_count)
    if update_config is not None:
        transforms.append(set_update_config(update_config))
    return eks.ManagedNodeGroup(
        f"{name}-nodes",
        cluster=args.cluster,
        node_role=role,
        ami_type=GPU_AMI_TYPE,
        capacity_type=EKS_CAPACITY_TYPE[reservation.kind],
        launch_template=aws.eks.NodeGroupLaunchTemplateArgs(
            id=template.id, version=template.latest_version.apply(str)),
        subnet_ids=[args.subnet_id],
        scaling_config=gpu_scaling_config(args, now=window.desired_nodes),
        **_scaling_ownership(args),
        labels=gpu_node_labels(args),
        taints=[aws.eks.NodeGroupTaintArgs(key=GPU_TAINT_KEY, value=GPU_TAINT_VALUE,
                                           effect=EKS_TAINT_EFFECTS[GPU_TAINT_EFFECT])],
        opts=pulumi.ResourceOptions(parent=parent, depends_on=list(args.after), transforms=transforms))
