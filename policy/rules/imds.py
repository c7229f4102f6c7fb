"""The instance metadata service of every node: IMDSv2 only, one network hop.

IMDS hands the node role's credentials to whoever asks from the instance. A pod on the pod network is
one hop further than the node, so a token requested with a hop limit of 1 never reaches it; requiring
tokens (IMDSv2) closes the tokenless path a hop limit does not cover. infra/imds.py sets both on
every launch template the program's node groups use.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .resources import LAUNCH_TEMPLATE, NODE_GROUP, UNKNOWN, StackResource, StackViolation, referenced, value_at

_FIX = ("set metadataOptions httpTokens: required and httpPutResponseHopLimit: 1 (infra/imds.py does for "
        "the program's node groups)")


def instance_metadata_violations(props: Mapping[str, Any]) -> list[str]:
    """A launch template requires IMDSv2 tokens and a hop limit of 1, or turns IMDS off."""
    options = props.get("metadataOptions")
    if options is UNKNOWN:
        return []
    if options is None:
        return [f"launch template sets no instance metadata options: its nodes take whatever the AMI allows, "
                f"IMDSv1 and hop limits that let pods read the node role's credentials included; {_FIX}"]
    endpoint, tokens, hops = (value_at(options, k) for k in ("httpEndpoint", "httpTokens", "httpPutResponseHopLimit"))
    if endpoint == "disabled":
        return []
    out = []
    if tokens not in ("required", UNKNOWN):
        out.append(f"launch template does not require IMDSv2 tokens (httpTokens {tokens!r}): a pod can read the "
                   f"node role's credentials with a tokenless (IMDSv1) request, whatever the hop limit; {_FIX}")
    if hops is not UNKNOWN and hops != 1:
        # Unset, EC2 takes the AMI's default: 2 for an AMI registered with ImdsSupport v2.0.
        shown = f"{hops:g}" if isinstance(hops, (int, float)) else repr(hops)
        how_far = "as far as the AMI's default" if hops is None else f"{shown} network hops"
        out.append(f"launch template's IMDSv2 tokens travel {how_far} (httpPutResponseHopLimit {shown}): pods "
                   f"one hop away from the node get the node role's credentials; {_FIX}")
    return out


def node_group_launch_template_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """Every node group launches from a launch template of this stack, so that the rule above judges
    its metadata options: without one EKS makes a template of its own, with metadata options this
    stack neither sets nor sees."""
    templates = [r for r in resources if r.type == LAUNCH_TEMPLATE]
    out = []
    for group in (r for r in resources if r.type == NODE_GROUP):
        template = group.props.get("launchTemplate")
        if template is UNKNOWN:
            continue
        if template is None:
            out.append(StackViolation(group.urn, "node group has no launch template: EKS launches its nodes from "
                                      "one of its own, whose instance metadata options this stack does not set; "
                                      "give it a launch template (pulumi-eks's enableIMDSv2 makes one)"))
        elif not referenced(group, "launchTemplate", templates, ("id", "name")):
            out.append(StackViolation(group.urn, "node group's launch template is not part of this stack, so its "
                                      "instance metadata options cannot be checked"))
    return out
