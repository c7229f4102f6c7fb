"""The EKS API endpoint: not open to the whole internet (a warning)."""

from __future__ import annotations

from typing import Any, Mapping

from .resources import UNKNOWN, as_list, value_at


OPEN_CIDRS = ("0.0.0.0/0", "::/0")


def public_api_access_warnings(props: Mapping[str, Any]) -> list[str]:
    """The public EKS API endpoint is not open to the whole internet (a warning: IAM
    authentication still applies, and some teams have no fixed address to list)."""
    vpc = props.get("vpcConfig")
    public, cidrs = value_at(vpc, "endpointPublicAccess"), value_at(vpc, "publicAccessCidrs")
    if public is False or UNKNOWN in (vpc, public, cidrs):
        return []
    open_to = [c for c in as_list(cidrs) if c in OPEN_CIDRS] or (
        ["0.0.0.0/0 (the default)"] if not as_list(cidrs) else [])
    if not open_to:
        return []
    return [f"the public EKS API endpoint accepts connections from {', '.join(open_to)}; set "
            "ray-eks:apiAccessCidrs to your own address or range (docs/SECURITY.md shows how)"]
