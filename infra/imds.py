"""The instance metadata service on every node: IMDSv2 only, and out of reach of pods.

IMDS hands out the node role's credentials to whoever asks from the instance. A pod on the pod
network reaches it through one more network hop than the node itself (the veth pair), so an IMDSv2
token requested with a hop limit of 1 never makes it back to the pod: only the node and
host-network pods (the VPC CNI, kube-proxy, the EKS Pod Identity agent, the Node Termination
Handler) can use IMDS. Tokens required (IMDSv2) closes the unauthenticated path that a hop limit
does not cover.

pulumi-eks 4.4.0 builds the launch template of a managed node group itself (the GPU group's, for
its EFA interfaces and placement group; the system group's once `enable_imd_sv2` asks for one).
Its `enableIMDSv2` sets `httpTokens: required` with `httpPutResponseHopLimit: 2`
(`nodejs/eks/nodes/nodegroup.ts`, `createMNGCustomLaunchTemplate`), which lets pods in, and it
takes no other metadata options. So `restrict_instance_metadata`, a transform on that launch
template (transforms reach the children of packaged components, as infra/health.py's does),
sets the options below; the reserved GPU group's own launch template takes them directly.
"""

from __future__ import annotations

from typing import Optional

import pulumi

LAUNCH_TEMPLATE_TYPE = "aws:ec2/launchTemplate:LaunchTemplate"
METADATA_OPTIONS = {"httpEndpoint": "enabled", "httpTokens": "required", "httpPutResponseHopLimit": 1}
"""IMDSv2 only, one network hop: the node and host-network pods, no pod on the pod network."""


def restrict_instance_metadata(args: pulumi.ResourceTransformArgs) -> Optional[pulumi.ResourceTransformResult]:
    """A transform for a ManagedNodeGroup: METADATA_OPTIONS on the launch template it creates."""
    if args.type_ != LAUNCH_TEMPLATE_TYPE:
        return None
    return pulumi.ResourceTransformResult(props={**args.props, "metadataOptions": dict(METADATA_OPTIONS)},
                                          opts=args.opts)


def launch_template_metadata_options() -> dict[str, object]:
    """METADATA_OPTIONS as a LaunchTemplate argument (snake_case keys)."""
    return {"http_endpoint": METADATA_OPTIONS["httpEndpoint"], "http_tokens": METADATA_OPTIONS["httpTokens"],
            "http_put_response_hop_limit": METADATA_OPTIONS["httpPutResponseHopLimit"]}
