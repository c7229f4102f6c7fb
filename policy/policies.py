"""The pulumi-policy wrappers around rules/: which rule runs on which resource type.

A wrapper turns the engine's properties into plain data (UNKNOWN where a value is not known during
preview), calls the rule and reports each message. Every policy is mandatory (a violation fails
`pulumi preview` and stops `pulumi up`) but `images-pinned-by-digest`, which warns: a stack that has
not locked its images yet must still preview, and `pulumi up` itself refuses an image not pinned by
digest unless the stack allows it (infra/images.py), which the pack cannot read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.proxy import UnknownValueError

import rules

MANDATORY = EnforcementLevel.MANDATORY
ADVISORY = EnforcementLevel.ADVISORY


def to_plain(value: Any) -> Any:
    """Engine properties (proxies that raise on unknown values) as dicts and lists, with UNKNOWN
    in place of each value not known during preview."""
    if isinstance(value, Mapping):
        out = {}
        for key in list(value):
            try:
                out[key] = to_plain(value[key])
            except UnknownValueError:
                out[key] = rules.UNKNOWN
        return out
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = []
        for i in range(len(value)):
            try:
                items.append(to_plain(value[i]))
            except UnknownValueError:
                items.append(rules.UNKNOWN)
        return items
    return value


def _resource_policy(*, name: str, description: str, types: tuple[str, ...],
                     rule: Callable[[str, Mapping[str, Any]], list[str]],
                     enforcement_level: EnforcementLevel = MANDATORY) -> ResourceValidationPolicy:
    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        if args.resource_type not in types:
            return
        for message in rule(args.resource_type, to_plain(args.props)):
            report_violation(message, None)

    return ResourceValidationPolicy(name=name, description=description, validate=validate,
                                    enforcement_level=enforcement_level)


def to_stack_resource(resource: PolicyResource) -> rules.StackResource:
    return rules.StackResource(
        urn=resource.urn,
        type=resource.resource_type,
        props=to_plain(resource.props),
        dependencies=tuple(d.urn for d in resource.dependencies),
        property_dependencies={k: tuple(d.urn for d in deps)
                               for k, deps in resource.property_dependencies.items()},
    )


def _stack_policy(*, name: str, description: str,
                  rule: Callable[[list[rules.StackResource]], list[rules.StackViolation]]
                  ) -> StackValidationPolicy:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        for violation in rule([to_stack_resource(r) for r in args.resources]):
            report_violation(violation.message, violation.urn)

    return StackValidationPolicy(name=name, description=description, validate=validate,
                                 enforcement_level=MANDATORY)


POLICIES = [
    _resource_policy(
        name="gpu-node-group-label-taint-launch-template",
        description="GPU node groups carry nvidia.com/gpu.present=true, the nvidia.com/gpu taint "
                    "and a launch template (the carrier of EFA).",
        types=(rules.NODE_GROUP,),
        rule=lambda _type, props: rules.gpu_node_group_violations(props)),
    _stack_policy(
        name="gpu-node-group-efa",
        description="Each GPU node group's launch template has EFA network interfaces and a "
                    "cluster placement group.",
        rule=rules.gpu_node_group_efa_violations),
    _stack_policy(
        name="capacity-reservation-matches",
        description="A launch template that targets a capacity reservation or Capacity Block "
                    "launches the reservation's instance type in its AZ (as EC2 reports them), "
                    "with market type capacity-block for a block.",
        rule=rules.capacity_reservation_violations),
    _resource_policy(
        name="launch-template-imdsv2-one-hop",
        description="Launch templates require IMDSv2 tokens with a hop limit of 1 (or turn IMDS off), so that "
                    "no pod reads the node role's credentials.",
        types=(rules.LAUNCH_TEMPLATE,),
        rule=lambda _type, props: rules.instance_metadata_violations(props)),
    _stack_policy(
        name="node-group-launch-template-in-stack",
        description="Every node group launches from a launch template of this stack, whose instance metadata "
                    "options the policy above checks.",
        rule=rules.node_group_launch_template_violations),
    _resource_policy(
        name="ray-worker-guaranteed-efa",
        description="Ray worker containers set requests equal to limits and the Ray container "
                    "requests vpc.amazonaws.com/efa.",
        types=(rules.RAY_CLUSTER,),
        rule=lambda _type, props: rules.ray_worker_violations(props)),
    _resource_policy(
        name="ray-not-exposed",
        description="No LoadBalancer (or any non-ClusterIP Service, or ingress) in front of Ray.",
        types=(rules.RAY_CLUSTER, rules.SERVICE),
        rule=lambda type_, props: (rules.ray_head_exposure_violations(props)
                                   if type_ == rules.RAY_CLUSTER
                                   else rules.service_exposure_violations(props))),
    _stack_policy(
        name="ray-pods-not-exposed",
        description="No Service whose selector picks the Ray pods (by any of their labels, whatever its name) "
                    "is a LoadBalancer or NodePort or has externalIPs, and no Ingress routes to the Ray pods.",
        rule=rules.ray_exposure_violations),
    _stack_policy(
        name="ray-namespace-network-policy",
        description="Every Ray pod is selected by a NetworkPolicy with Ingress rules, and none of the policies "
                    "that select it admits every source, every namespace or a slice of the internet.",
        rule=rules.ray_network_policy_violations),
    _stack_policy(
        name="ray-namespace-pod-security",
        description="The Ray namespace is declared by the stack and enforces the baseline (or restricted) Pod "
                    "Security Standard.",
        rule=rules.ray_pod_security_violations),
    _resource_policy(
        name="pinned-images",
        description="Container images are pinned by a version tag (vX.Y) or a digest.",
        types=(rules.RAY_CLUSTER, *rules.POD_SPEC_PATHS),
        rule=rules.workload_image_violations),
    _resource_policy(
        name="images-pinned-by-digest",
        description="Container images name their digest (@sha256:...), not only a tag its registry can move "
                    "(python -m infra lock-images pins the stack's). Advisory: pulumi up refuses them itself.",
        types=(rules.RAY_CLUSTER, *rules.POD_SPEC_PATHS),
        rule=rules.digest_pin_violations,
        enforcement_level=ADVISORY),
    _resource_policy(
        name="pinned-chart-versions",
        description="Helm charts are installed at an exact version, with no floating image tag "
                    "in their values.",
        types=(rules.HELM_RELEASE, rules.HELM_CHART),
        rule=lambda _type, props: rules.helm_violations(props)),
    _resource_policy(
        name="s3-public-access-blocked",
        description="S3 public access blocks set all four flags to true.",
        types=(rules.PUBLIC_ACCESS_BLOCK,),
        rule=lambda _type, props: rules.public_access_block_violations(props)),
    _resource_policy(
        name="s3-encryption-algorithm",
        description="S3 server-side encryption configurations use AES256 or KMS.",
        types=rules.ENCRYPTION_CONFIGS,
        rule=lambda _type, props: rules.encryption_config_violations(props)),
    _stack_policy(
        name="s3-bucket-private-and-encrypted",
        description="Every S3 bucket has a public access block, a server-side encryption "
                    "configuration and a policy that denies requests without TLS, of its own.",
        rule=rules.bucket_violations),
    _resource_policy(
        name="mlflow-access-least-privilege",
        description="An IAM policy that allows SageMaker MLflow actions names each one, on tracking "
                    "server ARNs only (no wildcard action or resource).",
        types=rules.IAM_POLICIES,
        rule=lambda _type, props: rules.mlflow_access_violations(props)),
    _stack_policy(
        name="mlflow-artifacts-in-stack-bucket",
        description="Every MLflow tracking server keeps its artifacts in a bucket of this stack (held "
                    "private and encrypted by the bucket policies).",
        rule=rules.tracking_server_violations),
    _resource_policy(
        name="eks-api-not-open-to-all",
        description="The public EKS API endpoint opens no more than a /8's worth of IPv4 (a /32's of IPv6) "
                    "addresses, however the CIDRs spell it, unless the cluster is tagged as meant to be open "
                    "(ray-eks:apiOpenToInternet).",
        types=(rules.EKS_CLUSTER,),
        rule=lambda _type, props: rules.public_api_access_violations(props)),
]
