"""The checkpoint bucket: its own public access block, default encryption, and a policy that denies
requests without TLS."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from .resources import (BUCKET_POLICY, BUCKETS, ENCRYPTION_CONFIGS, PUBLIC_ACCESS_BLOCK, UNKNOWN, StackResource,
                        StackViolation, as_list, referenced, value_at)

PUBLIC_ACCESS_FLAGS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                       "restrictPublicBuckets")
SSE_ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse")


def public_access_block_violations(props: Mapping[str, Any]) -> list[str]:
    """All four S3 public-access-block flags are true."""
    off = [f for f in PUBLIC_ACCESS_FLAGS if props.get(f) is not UNKNOWN and props.get(f) is not True]
    if not off:
        return []
    return [f"bucket public access block leaves {', '.join(off)} off; all four must be true"]


def encryption_config_violations(props: Mapping[str, Any]) -> list[str]:
    """A server-side encryption configuration sets default encryption with a real algorithm."""
    rules = props.get("rules")
    if rules is UNKNOWN:
        return []
    algorithms = [value_at(r, "applyServerSideEncryptionByDefault", "sseAlgorithm")
                  for r in as_list(rules)]
    if not algorithms:
        return ["server-side encryption configuration has no rule"]
    return [f"server-side encryption algorithm {a!r} is not one of {', '.join(SSE_ALGORITHMS)}"
            for a in algorithms if a is not UNKNOWN and a not in SSE_ALGORITHMS]


def denies_insecure_transport(policy: Any) -> bool:
    """A bucket policy (its JSON text) has a Deny of every action, for every principal, on the
    bucket and its objects, when `aws:SecureTransport` is false. True while the text is unknown."""
    if policy is UNKNOWN:
        return True
    try:
        document = json.loads(policy) if isinstance(policy, str) else policy
    except ValueError:
        return False
    for statement in as_list(value_at(document, "Statement")):
        if not isinstance(statement, Mapping) or statement.get("Effect") != "Deny":
            continue
        condition = value_at(statement, "Condition", "Bool", "aws:SecureTransport")
        resources = [r for r in as_list(statement.get("Resource")) if isinstance(r, str)]
        if (statement.get("Principal") in ("*", {"AWS": "*"}) and statement.get("Action") in ("s3:*", ["s3:*"])
                and str(condition).lower() == "false"
                and any(not r.endswith("/*") for r in resources) and any(r.endswith("/*") for r in resources)):
            return True
    return False


def _attached(resources: Sequence[StackResource], bucket: StackResource) -> list[StackResource]:
    """The resources whose `bucket` property names this bucket."""
    return [r for r in resources if referenced(r, "bucket", [bucket], ("bucket", "id"))]


def bucket_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """Every bucket has its own public access block, server-side encryption configuration, and a
    policy that denies requests without TLS.

    What those set is checked on each of them by public_access_block_violations and
    encryption_config_violations. Only the separate resources count: the Bucket's inline encryption block is
    deprecated in pulumi-aws 7, and its output reports the AES256 default S3 applies to every new bucket, which
    would hide a missing configuration.
    """
    blocks = [r for r in resources if r.type == PUBLIC_ACCESS_BLOCK]
    configs = [r for r in resources if r.type in ENCRYPTION_CONFIGS]
    policies = [r for r in resources if r.type == BUCKET_POLICY]
    out: list[StackViolation] = []
    for bucket in (r for r in resources if r.type in BUCKETS):
        if not _attached(blocks, bucket):
            out.append(StackViolation(bucket.urn, "bucket has no BucketPublicAccessBlock"))
        if not _attached(configs, bucket):
            out.append(StackViolation(bucket.urn, "bucket has no "
                                      "BucketServerSideEncryptionConfiguration"))
        if not any(denies_insecure_transport(p.props.get("policy")) for p in _attached(policies, bucket)):
            out.append(StackViolation(bucket.urn, "bucket has no BucketPolicy that denies requests without TLS "
                                      "(a Deny of s3:* on the bucket and its objects when aws:SecureTransport "
                                      "is false)"))
    return out
