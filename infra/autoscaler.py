"""The Cluster Autoscaler (with `gpuIdleMinutes`): a pinned Helm release on the system nodes, and
the one IAM identity it acts with, through EKS Pod Identity. Its values and policy are
infra/scale_to_zero.py's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.helm_values import CLUSTER_AUTOSCALER
from infra.scale_to_zero import (CLUSTER_AUTOSCALER_NAMESPACE, CLUSTER_AUTOSCALER_SERVICE_ACCOUNT,
                                 cluster_autoscaler_policy)
from infra.storage import POD_IDENTITY_TRUST


@dataclass(frozen=True, kw_only=True)
class ClusterAutoscalerArgs:
    provider: k8s.Provider
    cluster_name: str
    """The EKS cluster's name: the IAM conditions and the discovery tag carry it."""
    region: str
    values: Mapping[str, Any]
    """The release's Helm values (infra.helm_values.chart_values)."""
    version: str
    """The chart version (stack setting `clusterAutoscalerChartVersion`)."""
    cluster: pulumi.Resource
    """The Pod Identity association waits for the cluster."""
    system_nodes: pulumi.Resource
    """The release waits for the system nodes it runs on."""


class ClusterAutoscaler(pulumi.ComponentResource):
    """An IAM role allowed to resize the GPU Auto Scaling group only, bound by Pod Identity to the
    autoscaler's service account, and the Helm release, created after that binding: EKS gives
    credentials only to pods admitted once it exists."""

    def __init__(self, name: str, args: ClusterAutoscalerArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:ClusterAutoscaler", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        role = aws.iam.Role(f"{name}-role", assume_role_policy=json.dumps(POD_IDENTITY_TRUST),
                            opts=child)
        partition = aws.get_partition_output(opts=pulumi.InvokeOptions(parent=self)).partition
        aws.iam.RolePolicy(
            f"{name}-access", role=role.id,
            policy=partition.apply(lambda p: json.dumps(cluster_autoscaler_policy(
                cluster_name=args.cluster_name, partition=p, region=args.region))),
            opts=child)
        association = aws.eks.PodIdentityAssociation(
            f"{name}-pod-identity", cluster_name=args.cluster_name,
            namespace=CLUSTER_AUTOSCALER_NAMESPACE,
            service_account=CLUSTER_AUTOSCALER_SERVICE_ACCOUNT, role_arn=role.arn,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.cluster]))
        self.release = k8s.helm.v3.Release(
            f"{name}-release",
            name=CLUSTER_AUTOSCALER.name,
            chart=CLUSTER_AUTOSCALER.name,
            version=args.version,
            repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=CLUSTER_AUTOSCALER.repository),
            namespace=CLUSTER_AUTOSCALER.namespace,
            values=dict(args.values),
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider,
                                        depends_on=[association, args.system_nodes]))
        self.register_outputs({"release": self.release.status})
