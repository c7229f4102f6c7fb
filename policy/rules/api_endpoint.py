"""The EKS API endpoint: not open to the whole internet unless the stack says so."""

from __future__ import annotations

from typing import Any, Mapping

from .resources import UNKNOWN, as_list, value_at


OPEN_CIDRS = ("0.0.0.0/0", "::/0")
OPEN_TO_INTERNET_TAG = "ray-eks:api-open-to-internet"
"""A tag on the EKS cluster, valued "true", with which a stack says it means its API endpoint to be
open to every address (the program sets it from `ray-eks:apiOpenToInternet`; infra/cluster.py
spells the same key: the pack is a program of its own)."""


def public_api_access_violations(props: Mapping[str, Any]) -> list[str]:
    """The public EKS API endpoint is not open to the whole internet, unless the cluster carries
    OPEN_TO_INTERNET_TAG. The endpoint authenticates with IAM, but a Ray cluster executes whatever
    code it is sent: one stolen or leaked credential anywhere is then enough, and scanners find
    open endpoints within hours."""
    vpc = props.get("vpcConfig")
    public, cidrs = value_at(vpc, "endpointPublicAccess"), value_at(vpc, "publicAccessCidrs")
    if public is False or UNKNOWN in (vpc, public, cidrs):
        return []
    open_to = [c for c in as_list(cidrs) if c in OPEN_CIDRS] or (
        ["0.0.0.0/0 (the default)"] if not as_list(cidrs) else [])
    tags = props.get("tags")
    if not open_to or tags is UNKNOWN or value_at(tags, OPEN_TO_INTERNET_TAG) == "true":
        return []
    return [f"the public EKS API endpoint accepts connections from {', '.join(open_to)}: anyone "
            "on the internet may try a credential against the API of a cluster that runs whatever "
            "code its Ray jobs are sent. Set ray-eks:apiAccessCidrs to your own address or range, "
            "or leave it empty for a private endpoint (docs/SECURITY.md shows both); a stack that "
            "means it says so with ray-eks:apiOpenToInternet: true"]
