"""What `submit --dry-run` checks of a stack's cluster beyond the run's own config, data and fit,
without reaching the cluster: the tools `submit --stack` runs (pulumi reads the stack's outputs,
kubectl opens the port-forward, aws gives the kubeconfig its token) and the AWS credentials they run
with, asked of STS in the stack's region. Each failure is what `submit` itself would stop at, said
before anything starts."""

from __future__ import annotations

import shutil

from workloads.client.cluster import UnreachableError

STACK_TOOLS = {"pulumi": "read the stack's outputs", "kubectl": "port-forward to the Ray head",
               "aws": "authenticate to the EKS cluster (aws eks get-token)"}


def check_tools() -> str:
    """One line naming the tools found; UnreachableError for the first missing, with what it is for."""
    for tool, why in STACK_TOOLS.items():
        if shutil.which(tool) is None:
            raise UnreachableError(f"{tool} is not on PATH; submit --stack needs it to {why}")
    *first, last = STACK_TOOLS
    return f"{', '.join(first)} and {last} are on PATH"


def check_aws_credentials(*, region: str) -> str:
    """One line naming the AWS identity the stack's cluster would be reached with; UnreachableError
    with capacity's classification of the failure (no credentials, an expired session, no network)."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    from capacity.aws import classify  # the probe's reading of AWS failures, with what to do about each

    try:
        identity = boto3.Session(region_name=region).client("sts").get_caller_identity()
    except (BotoCoreError, ClientError) as exc:
        raise UnreachableError(classify(exc, action="sts:GetCallerIdentity").summary) from None
    return f"AWS account {identity['Account']} as {identity['Arn']}"
