"""The EKS cluster: API authentication with access entries, no default node group, a pinned
version in standard support, and a Kubernetes provider for everything inside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pulumi
import pulumi_aws as aws
import pulumi_eks as eks
import pulumi_kubernetes as k8s

ADMIN_POLICY = "cluster-access-policy/AmazonEKSClusterAdminPolicy"


def admin_access_entries(principal_arns: Sequence[str]) -> dict[str, eks.AccessEntryArgs]:
    """Cluster-admin access entries, one per IAM principal, in the principal's own partition."""
    entries = {}
    for i, arn in enumerate(principal_arns):
        partition = arn.split(":")[1]
        entries[f"admin-{i}"] = eks.AccessEntryArgs(
            principal_arn=arn,
            access_policies={"cluster-admin": eks.AccessPolicyAssociationArgs(
                policy_arn=f"arn:{partition}:eks::aws:{ADMIN_POLICY}",
                access_scope=aws.eks.AccessPolicyAssociationAccessScopeArgs(type="cluster"))})
    return entries


@dataclass(frozen=True, kw_only=True)
class EksClusterArgs:
    cluster_name: str
    """Physical name of the EKS cluster (the subnets are tagged with it)."""
    kubernetes_version: str
    vpc_id: pulumi.Input[str]
    public_subnet_ids: Sequence[pulumi.Input[str]]
    private_subnet_ids: Sequence[pulumi.Input[str]]
    api_access_cidrs: Sequence[str]
    """CIDRs that may reach the public API endpoint; nodes use the private endpoint."""
    admin_principal_arns: Sequence[str]
    pod_identity_agent_version: str
    """The EKS Pod Identity agent add-on version, pinned (not whatever EKS defaults to that day)."""


class EksCluster(pulumi.ComponentResource):
    """eks.Cluster, the EKS Pod Identity agent, and a Kubernetes provider for the cluster."""

    def __init__(self, name: str, args: EksClusterArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:EksCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.cluster = eks.Cluster(
            f"{name}-eks",
            name=args.cluster_name,
            version=args.kubernetes_version,
            upgrade_policy=aws.eks.ClusterUpgradePolicyArgs(support_type="STANDARD"),
            vpc_id=args.vpc_id,
            public_subnet_ids=list(args.public_subnet_ids),
            private_subnet_ids=list(args.private_subnet_ids),
            node_associate_public_ip_address=False,
            skip_default_node_group=True,
            authentication_mode=eks.AuthenticationMode.API,
            access_entries=admin_access_entries(args.admin_principal_arns),
            endpoint_public_access=True,
            endpoint_private_access=True,
            public_access_cidrs=list(args.api_access_cidrs),
            opts=child)
        # Lets the checkpoint role reach the Ray pods (infra/storage.py) without an OIDC provider.
        aws.eks.Addon(f"{name}-pod-identity-agent", cluster_name=args.cluster_name,
                      addon_name="eks-pod-identity-agent",
                      addon_version=args.pod_identity_agent_version,
                      opts=pulumi.ResourceOptions(parent=self, depends_on=[self.cluster]))
        self.cluster_name = pulumi.Output.from_input(args.cluster_name)
        self.kubeconfig = pulumi.Output.secret(self.cluster.kubeconfig_json)
        self.provider = k8s.Provider(f"{name}-k8s", kubeconfig=self.kubeconfig,
                                     enable_server_side_apply=True, opts=child)
        self.register_outputs({"clusterName": self.cluster_name, "kubeconfig": self.kubeconfig})
