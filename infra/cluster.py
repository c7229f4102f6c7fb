"""The EKS cluster: API authentication with access entries, no default node group, a pinned
version in standard support, its API endpoint private unless the stack names who may reach it, and a
Kubernetes provider for everything inside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import json

import pulumi
import pulumi_aws as aws
import pulumi_eks as eks
import pulumi_kubernetes as k8s

from infra.storage import POD_IDENTITY_TRUST

ADMIN_POLICY = "cluster-access-policy/AmazonEKSClusterAdminPolicy"
VPC_CNI_SERVICE_ACCOUNT = "aws-node"
"""The VPC CNI's service account (kube-system), created by the add-on."""
VPC_CNI_POLICY = "AmazonEKS_CNI_Policy"
VPC_CNI_CONFIGURATION = {"enableNetworkPolicy": "true"}
"""The add-on's configuration: its network policy agent enforces NetworkPolicy objects (the VPC CNI
enforces none without it; infra/network_policy.py has the Ray namespace's)."""
CONTROL_PLANE_LOG_TYPES = ("audit", "authenticator")
"""EKS control-plane logs sent to CloudWatch: who did what through the API (audit), and which IAM
identity each request authenticated as (authenticator)."""
CONTROL_PLANE_LOG_RETENTION_DAYS = 90
"""How long CloudWatch keeps them (EKS's own log group would keep them, and bill them, for ever)."""
OPEN_TO_INTERNET_TAG = "ray-eks:api-open-to-internet"
"""On the EKS cluster, "true", when the stack says its API may be open to every address
(`apiOpenToInternet`): the policy pack refuses 0.0.0.0/0 without it (policy/rules/api_endpoint.py)."""


def endpoint_access(api_access_cidrs: Sequence[str], *, open_to_internet: bool) -> dict[str, object]:
    """eks.Cluster arguments for the API endpoint: private always (the nodes use it); public only
    for the CIDRs the stack names, never EKS's default of every address."""
    access: dict[str, object] = {"endpoint_private_access": True,
                                 "endpoint_public_access": bool(api_access_cidrs)}
    if api_access_cidrs:
        access["public_access_cidrs"] = list(api_access_cidrs)
    if open_to_internet:
        access["cluster_tags"] = {OPEN_TO_INTERNET_TAG: "true"}
    return access


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
    """CIDRs that may reach the public API endpoint; none: no public endpoint. Nodes use the
    private endpoint."""
    api_open_to_internet: bool = False
    """The stack means `api_access_cidrs` to include 0.0.0.0/0 (tagged on the cluster)."""
    admin_principal_arns: Sequence[str]
    pod_identity_agent_version: str
    """The EKS Pod Identity agent add-on version, pinned (not whatever EKS defaults to that day)."""
    vpc_cni_version: str
    """The VPC CNI add-on version, pinned (pulumi-eks would install the newest on the day)."""


class EksCluster(pulumi.ComponentResource):
    """eks.Cluster, the EKS Pod Identity agent, the VPC CNI with its own identity and network
    policy enforcement, and a Kubernetes provider for the cluster."""

    def __init__(self, name: str, args: EksClusterArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:EksCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # The group EKS writes the control-plane logs to, made first so that it has a retention.
        logs = aws.cloudwatch.LogGroup(f"{name}-control-plane-logs", name=f"/aws/eks/{args.cluster_name}/cluster",
                                       retention_in_days=CONTROL_PLANE_LOG_RETENTION_DAYS, opts=child)
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
            # The VPC CNI add-on is declared below, with its Pod Identity association and network
            # policies: pulumi-eks's own takes neither (its VpcCniOptions has IRSA's role ARN only).
            use_default_vpc_cni=True,
            authentication_mode=eks.AuthenticationMode.API,
            enabled_cluster_log_types=list(CONTROL_PLANE_LOG_TYPES),
            access_entries=admin_access_entries(args.admin_principal_arns),
            **endpoint_access(args.api_access_cidrs, open_to_internet=args.api_open_to_internet),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[logs]))
        # Lets the checkpoint role reach the Ray pods (infra/storage.py) without an OIDC provider.
        agent = aws.eks.Addon(f"{name}-pod-identity-agent", cluster_name=args.cluster_name,
                              addon_name="eks-pod-identity-agent",
                              addon_version=args.pod_identity_agent_version,
                              opts=pulumi.ResourceOptions(parent=self, depends_on=[self.cluster]))
        self.vpc_cni = self._vpc_cni(name, args, after=[self.cluster, agent])
        self.cluster_name = pulumi.Output.from_input(args.cluster_name)
        self.kubeconfig = pulumi.Output.secret(self.cluster.kubeconfig_json)
        self.provider = k8s.Provider(f"{name}-k8s", kubeconfig=self.kubeconfig,
                                     enable_server_side_apply=True, opts=child)
        self.register_outputs({"clusterName": self.cluster_name, "kubeconfig": self.kubeconfig})

    def _vpc_cni(self, name: str, args: EksClusterArgs, *, after: Sequence[pulumi.Resource]) -> aws.eks.Addon:
        """The VPC CNI add-on: its network-interface permissions on a role of its own, bound by Pod
        Identity to `kube-system/aws-node` (off the node roles, where every pod that reached IMDS
        had them), and network policy enforcement on. EKS creates the association with the
        add-on; the node groups wait for it, so the CNI's pods are admitted after it."""
        child = pulumi.ResourceOptions(parent=self)
        role = aws.iam.Role(f"{name}-vpc-cni-role", assume_role_policy=json.dumps(POD_IDENTITY_TRUST),
                            opts=child)
        partition = aws.get_partition_output(opts=pulumi.InvokeOptions(parent=self)).partition
        policy = aws.iam.RolePolicyAttachment(
            f"{name}-vpc-cni-policy", role=role.name,
            policy_arn=pulumi.Output.concat("arn:", partition, ":iam::aws:policy/", VPC_CNI_POLICY), opts=child)
        return aws.eks.Addon(
            f"{name}-vpc-cni", cluster_name=args.cluster_name, addon_name="vpc-cni",
            addon_version=args.vpc_cni_version,
            configuration_values=json.dumps(VPC_CNI_CONFIGURATION),
            pod_identity_associations=[aws.eks.AddonPodIdentityAssociationArgs(
                role_arn=role.arn, service_account=VPC_CNI_SERVICE_ACCOUNT)],
            # Adopt the aws-node EKS installs with the cluster, and keep it if the add-on goes.
            resolve_conflicts_on_create="OVERWRITE", resolve_conflicts_on_update="OVERWRITE",
            preserve=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*after, policy]))
