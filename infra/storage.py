"""The checkpoint bucket and the one identity allowed to use it: the Ray pods' service account,
through EKS Pod Identity."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

OBJECT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                  "s3:ListMultipartUploadParts")


def pod_session_condition(*, cluster_name: str, namespace: str, service_account: str) -> dict[str, Any]:
    """Only sessions Pod Identity tagged with this cluster, namespace and service account."""
    return {"StringEquals": {
        "aws:PrincipalTag/eks-cluster-name": cluster_name,
        "aws:PrincipalTag/kubernetes-namespace": namespace,
        "aws:PrincipalTag/kubernetes-service-account": service_account,
    }}


def checkpoint_policy(*, bucket_arn: str, key_prefix: str, cluster_name: str, namespace: str,
                      service_account: str) -> dict[str, Any]:
    """Read/write under `key_prefix` only, and only for sessions Pod Identity tagged with this
    cluster, namespace and service account."""
    principal = pod_session_condition(cluster_name=cluster_name, namespace=namespace,
                                      service_account=service_account)
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "Objects", "Effect": "Allow", "Action": list(OBJECT_ACTIONS),
             "Resource": f"{bucket_arn}/{key_prefix}/*", "Condition": principal},
            # Listing is bucket-wide because HeadBucket (pyarrow's S3 filesystem checks the
            # bucket) carries no prefix to condition on; the bucket holds only this stack's runs.
            {"Sid": "List", "Effect": "Allow", "Action": ["s3:ListBucket"],
             "Resource": bucket_arn, "Condition": principal},
        ],
    }


def secure_transport_policy(*, bucket_arn: str) -> dict[str, Any]:
    """The bucket's own policy: every request without TLS is denied, whoever sends it (a deny
    outranks any allow, including the checkpoint role's). It is no public grant, so the public
    access block lets it be."""
    return {
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "DenyWithoutTls", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
            "Resource": [bucket_arn, f"{bucket_arn}/*"],
            "Condition": {"Bool": {"aws:SecureTransport": "false"}},
        }],
    }


def lifecycle_rules(*, noncurrent_version_days: int, incomplete_upload_days: int
                    ) -> list[dict[str, Any]]:
    """S3 lifecycle rules that keep a versioned checkpoint bucket from growing forever: Ray
    deletes the checkpoints it prunes, which versioning keeps as noncurrent versions, and a
    checkpoint write that dies leaves its multipart upload's parts behind (both billed)."""
    everything: dict[str, Any] = {}  # an empty filter: every object in the bucket
    rules: list[dict[str, Any]] = [{
        "id": "abort-incomplete-multipart-uploads", "status": "Enabled", "filter": everything,
        "abort_incomplete_multipart_upload": {"days_after_initiation": incomplete_upload_days},
    }]
    if noncurrent_version_days:
        rules += [{
            "id": "expire-noncurrent-versions", "status": "Enabled", "filter": everything,
            "noncurrent_version_expiration": {"noncurrent_days": noncurrent_version_days},
        }, {
            # Once its old versions expire, a deleted object is a lone delete marker.
            "id": "remove-expired-delete-markers", "status": "Enabled", "filter": everything,
            "expiration": {"expired_object_delete_marker": True},
        }]
    return rules


POD_IDENTITY_TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": ["sts:AssumeRole", "sts:TagSession"],
                   "Principal": {"Service": "pods.eks.amazonaws.com"}}],
}


@dataclass(frozen=True, kw_only=True)
class CheckpointStorageArgs:
    bucket_prefix: str
    """Bucket name prefix; a random suffix makes it globally unique."""
    retain_on_destroy: bool
    """Keep the bucket and its checkpoints on `pulumi destroy`."""
    noncurrent_version_days: int
    """Days before S3 expires a noncurrent object version (0: never)."""
    incomplete_upload_days: int
    """Days before S3 aborts an unfinished multipart upload."""
    key_prefix: str
    """Key prefix the Ray pods may use."""
    cluster_name: pulumi.Input[str]
    namespace: str
    service_account: str
    cluster: pulumi.Resource
    """The pod identity association waits for the cluster."""


class CheckpointStorage(pulumi.ComponentResource):
    """S3 bucket (SSE, TLS only, versioning with a lifecycle, public access blocked) and a Pod Identity
    role. `pod_identity` is the association: pods admitted before it exists get no credentials."""

    def __init__(self, name: str, args: CheckpointStorageArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:CheckpointStorage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # A kept bucket keeps its configuration too: deleting a configuration resource removes
        # it from the bucket (the public access block and the lifecycle gone, versioning
        # suspended), so every resource that configures the bucket is retained with it.
        kept = pulumi.ResourceOptions(parent=self, retain_on_delete=args.retain_on_destroy)
        bucket = aws.s3.Bucket(
            f"{name}-bucket", bucket_prefix=f"{args.bucket_prefix}-",
            force_destroy=not args.retain_on_destroy, opts=kept)
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-sse", bucket=bucket.id,
            rules=[{"apply_server_side_encryption_by_default": {"sse_algorithm": "AES256"}}],
            opts=kept)
        versioning = aws.s3.BucketVersioning(f"{name}-versioning", bucket=bucket.id,
                                             versioning_configuration={"status": "Enabled"},
                                             opts=kept)
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-lifecycle", bucket=bucket.id,
            rules=lifecycle_rules(noncurrent_version_days=args.noncurrent_version_days,
                                  incomplete_upload_days=args.incomplete_upload_days),
            # After versioning: the rules act on the versions it keeps, and S3 refuses two
            # concurrent changes to one bucket's configuration.
            opts=pulumi.ResourceOptions.merge(kept, pulumi.ResourceOptions(
                depends_on=[versioning])))
        access_block = aws.s3.BucketPublicAccessBlock(
            f"{name}-public-access-block", bucket=bucket.id, block_public_acls=True,
            block_public_policy=True, ignore_public_acls=True, restrict_public_buckets=True,
            opts=kept)
        aws.s3.BucketOwnershipControls(f"{name}-ownership", bucket=bucket.id,
                                       rule={"object_ownership": "BucketOwnerEnforced"},
                                       opts=kept)
        aws.s3.BucketPolicy(
            f"{name}-tls-only", bucket=bucket.id,
            policy=bucket.arn.apply(lambda arn: json.dumps(secure_transport_policy(bucket_arn=arn))),
            # After the public access block: S3 checks a new policy against it.
            opts=pulumi.ResourceOptions.merge(kept, pulumi.ResourceOptions(depends_on=[access_block])))

        role = aws.iam.Role(f"{name}-role", assume_role_policy=json.dumps(POD_IDENTITY_TRUST),
                            opts=child)
        aws.iam.RolePolicy(
            f"{name}-access", role=role.id,
            policy=pulumi.Output.all(bucket.arn, args.cluster_name).apply(
                lambda a: json.dumps(checkpoint_policy(
                    bucket_arn=a[0], key_prefix=args.key_prefix, cluster_name=a[1],
                    namespace=args.namespace, service_account=args.service_account))),
            opts=child)
        self.pod_identity = aws.eks.PodIdentityAssociation(
            f"{name}-pod-identity", cluster_name=args.cluster_name, namespace=args.namespace,
            service_account=args.service_account, role_arn=role.arn,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.cluster]))

        self.bucket_name = bucket.bucket
        self.bucket_arn = bucket.arn
        self.key_prefix = args.key_prefix
        self.pod_role_name = role.id
        """The Ray pods' role: infra/tracking.py adds its tracking server's access to it."""
        self.uri = pulumi.Output.concat("s3://", bucket.bucket, "/", args.key_prefix)
        self.register_outputs({"bucketName": self.bucket_name, "uri": self.uri})
