"""The checkpoint bucket: its own public access block and default encryption."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .resources import (BUCKETS, ENCRYPTION_CONFIGS, PUBLIC_ACCESS_BLOCK, UNKNOWN, StackResource, StackViolation,
                        as_list, referenced, value_at)

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


def _attached(resources: Sequence[StackResource], bucket: StackResource) -> list[StackResource]:
    """The resources whose `bucket` property names this bucket."""
    return [r for r in resources if referenced(r, "bucket", [bucket], ("bucket", "id"))]


def bucket_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """Every bucket has its own public access block and server-side encryption configuration.

    What those set is checked on each of them by public_access_block_violations and
    encryption_config_violations. Only the separate resources count: the Bucket's inline encryption block is
    deprecated in pulumi-aws 7, and its output reports the AES256 default S3 applies to every new bucket, which
    would hide a missing configuration.
    """
    blocks = [r for r in resources if r.type == PUBLIC_ACCESS_BLOCK]
    configs = [r for r in resources if r.type in ENCRYPTION_CONFIGS]
    out: list[StackViolation] = []
    for bucket in (r for r in resources if r.type in BUCKETS):
        if not _attached(blocks, bucket):
            out.append(StackViolation(bucket.urn, "bucket has no BucketPublicAccessBlock"))
        if not _attached(configs, bucket):
            out.append(StackViolation(bucket.urn, "bucket has no "
                                      "BucketServerSideEncryptionConfiguration"))
    return out
