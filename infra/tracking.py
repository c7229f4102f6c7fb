"""The runs' experiment tracker (`ray-eks:mlflow`): a SageMaker managed MLflow tracking server whose
artifact store is a prefix of the checkpoint bucket, and the Ray pods' access to it and nothing more.

The Ray pods (rank 0 of each run, and the job's driver) call MLflow's REST API on the server, signed
with their Pod Identity credentials by the sagemaker-mlflow plugin: their role gets the
`sagemaker-mlflow:` actions the loop uses, on this server's ARN only. They write artifacts (the run
summary) straight to S3, under the checkpoint prefix the checkpoint policy already grants them
(infra/storage.py). The server itself reads and writes the artifact prefix through a role of its
own that SageMaker assumes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.storage import OBJECT_ACTIONS, pod_session_condition

ARTIFACT_DIR = "mlflow"
"""The artifact store's folder under the checkpoint bucket's prefix."""

POD_ACTIONS = (
    # experiment: found by name, created when missing
    "sagemaker-mlflow:GetExperimentByName", "sagemaker-mlflow:CreateExperiment",
    # the run: found again (by id, or by its run name), created, its status set
    "sagemaker-mlflow:GetRun", "sagemaker-mlflow:SearchRuns", "sagemaker-mlflow:CreateRun",
    "sagemaker-mlflow:UpdateRun",
    # parameters, metrics and tags in batches; the driver's tags
    "sagemaker-mlflow:LogBatch", "sagemaker-mlflow:SetTag",
)
"""What workloads/train/tracking.py calls (MlflowSink), by its IAM action name."""

SAGEMAKER_TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                   "Principal": {"Service": "sagemaker.amazonaws.com"}}],
}


def server_name(stack_name: str) -> str:
    """A tracking server name SageMaker takes (letters, digits, single dashes between them)."""
    return re.sub(r"-+", "-", re.sub(r"[^A-Za-z0-9]", "-", stack_name)).strip("-")[:256]


def artifact_prefix(key_prefix: str) -> str:
    return f"{key_prefix}/{ARTIFACT_DIR}"


def server_artifact_policy(*, bucket_arn: str, key_prefix: str) -> dict[str, Any]:
    """The tracking server's role: objects under the artifact prefix, and listing only that prefix."""
    prefix = artifact_prefix(key_prefix)
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "Artifacts", "Effect": "Allow", "Action": list(OBJECT_ACTIONS),
             "Resource": f"{bucket_arn}/{prefix}/*"},
            {"Sid": "List", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": bucket_arn,
             "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}},
            {"Sid": "Locate", "Effect": "Allow", "Action": ["s3:GetBucketLocation"], "Resource": bucket_arn},
        ],
    }


def pod_tracking_policy(*, server_arn: str, cluster_name: str, namespace: str,
                        service_account: str) -> dict[str, Any]:
    """The Ray pods' role: POD_ACTIONS on this tracking server only, for their Pod Identity sessions."""
    return {
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "TrackRuns", "Effect": "Allow", "Action": list(POD_ACTIONS), "Resource": server_arn,
            "Condition": pod_session_condition(cluster_name=cluster_name, namespace=namespace,
                                               service_account=service_account),
        }],
    }


@dataclass(frozen=True, kw_only=True)
class MlflowTrackingArgs:
    server_name: str
    """The tracking server's name (part of its ARN): the stack's name, `ray-eks-<stack>`."""
    size: str
    """Small, Medium or Large."""
    bucket_name: pulumi.Input[str]
    bucket_arn: pulumi.Input[str]
    key_prefix: str
    """The checkpoint prefix; artifacts go under `<key_prefix>/mlflow`."""
    pod_role_name: pulumi.Input[str]
    """The Ray pods' Pod Identity role."""
    cluster_name: pulumi.Input[str]
    namespace: str
    service_account: str


class MlflowTracking(pulumi.ComponentResource):
    """The tracking server, its own role for the artifact store, and the pods' access to it."""

    def __init__(self, name: str, args: MlflowTrackingArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:MlflowTracking", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        role = aws.iam.Role(f"{name}-server-role", assume_role_policy=json.dumps(SAGEMAKER_TRUST), opts=child)
        artifacts = aws.iam.RolePolicy(
            f"{name}-server-artifacts", role=role.id,
            policy=pulumi.Output.from_input(args.bucket_arn).apply(
                lambda arn: json.dumps(server_artifact_policy(bucket_arn=arn, key_prefix=args.key_prefix))),
            opts=child)
        server = aws.sagemaker.MlflowTrackingServer(
            f"{name}-server", tracking_server_name=server_name(args.server_name), tracking_server_size=args.size,
            artifact_store_uri=pulumi.Output.concat("s3://", args.bucket_name, "/", artifact_prefix(args.key_prefix)),
            role_arn=role.arn, automatic_model_registration=False,
            # SageMaker checks the role's access to the artifact store as it creates the server.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[artifacts]))
        aws.iam.RolePolicy(
            f"{name}-pod-access", role=args.pod_role_name,
            policy=pulumi.Output.all(server.arn, args.cluster_name).apply(lambda a: json.dumps(pod_tracking_policy(
                server_arn=a[0], cluster_name=a[1], namespace=args.namespace,
                service_account=args.service_account))),
            opts=child)
        self.arn = server.arn
        self.ui_url = server.tracking_server_url
        self.register_outputs({"arn": self.arn, "uiUrl": self.ui_url})
