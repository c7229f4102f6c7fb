"""The stack's invariants as pure functions over resource properties.

Each resource rule takes one resource's properties (plain dicts and lists, camelCase keys as the
Pulumi engine sends them; the image rule also its type) and returns a list of violation messages; an
empty list means compliant.
Each stack rule takes every resource of the stack and returns (urn, message) pairs. Nothing here
imports Pulumi, so the rules are tested as data.

During `pulumi preview` a property that depends on another resource's output is not known yet; the
policy wrappers hand it over as `UNKNOWN`. A rule says nothing about a value it cannot see: the
same rule runs again at `pulumi up`, where every input is known before the resource is created.

The package, one module per concern: `resources` (type tokens, UNKNOWN, the helpers), `gpu_nodes`,
`reservations`, `imds`, `ray_pods`, `ray_namespace` (which pods are Ray's, which selectors pick them),
`ray_reach` (Services, Ingresses and NetworkPolicies in front of them), `pod_security`, `images`,
`buckets`, `api_endpoint`, `tracking`. The policy pack imports them from
here (`import rules`: policy/ is the pack's import root).
"""

from .api_endpoint import (OPEN_ADDRESS_LIMITS, OPEN_TO_INTERNET_TAG, addresses_opened,
                           public_api_access_violations)
from .buckets import (PUBLIC_ACCESS_FLAGS, SSE_ALGORITHMS, bucket_violations, denies_insecure_transport,
                      encryption_config_violations, public_access_block_violations)
from .gpu_nodes import (GPU_LABEL_KEY, GPU_LABEL_VALUE, GPU_TAINT_KEY, PRIMARY_INTERFACE_TYPES,
                        efa_launch_template_violations, gpu_node_group_efa_violations, gpu_node_group_violations,
                        is_gpu_node_group)
from .images import (digest_pin_violations, helm_violations, image_pin_violation, tag_pin_violation,
                     workload_image_violations)
from .imds import instance_metadata_violations, node_group_launch_template_violations
from .pod_security import ENFORCE_LABEL, ENFORCED_LEVELS, ray_pod_security_violations
from .ray_namespace import RayPod, head_service_name, label_selector_matches, ray_pods_of, service_selects
from .ray_reach import ray_exposure_violations, ray_network_policy_violations
from .ray_pods import (ALLOWED_SERVICE_TYPES, EFA_RESOURCE, parse_quantity, ray_head_exposure_violations,
                       ray_worker_violations, selects_ray_pods, service_exposure_violations)
from .reservations import RESERVATION_TAG_KEYS, capacity_reservation_violations, reservation_target
from .tracking import (IAM_POLICIES, MLFLOW_TRACKING_SERVER, mlflow_access_violations,
                       tracking_server_violations)
from .resources import (BUCKET_POLICY, BUCKETS, CAPACITY_BLOCK, CAPACITY_RESERVATION, EKS_CLUSTER, ENCRYPTION_CONFIGS,
                        HELM_CHART, HELM_RELEASE, INGRESS, LAUNCH_TEMPLATE, NAMESPACE, NETWORK_POLICY, NODE_GROUP,
                        PLACEMENT_GROUP, POD_SPEC_PATHS, PUBLIC_ACCESS_BLOCK, RAY_CLUSTER, SERVICE, SUBNET, UNKNOWN,
                        StackResource, StackViolation)

__all__ = [
    "OPEN_ADDRESS_LIMITS", "OPEN_TO_INTERNET_TAG", "addresses_opened", "public_api_access_violations",
    "PUBLIC_ACCESS_FLAGS", "SSE_ALGORITHMS", "bucket_violations", "denies_insecure_transport",
    "encryption_config_violations",
    "public_access_block_violations",
    "GPU_LABEL_KEY", "GPU_LABEL_VALUE", "GPU_TAINT_KEY", "PRIMARY_INTERFACE_TYPES", "efa_launch_template_violations",
    "gpu_node_group_efa_violations", "gpu_node_group_violations", "is_gpu_node_group",
    "digest_pin_violations", "helm_violations", "image_pin_violation", "tag_pin_violation",
    "workload_image_violations",
    "instance_metadata_violations", "node_group_launch_template_violations",
    "ENFORCE_LABEL", "ENFORCED_LEVELS", "ray_pod_security_violations",
    "RayPod", "head_service_name", "label_selector_matches", "ray_pods_of", "service_selects",
    "ray_exposure_violations", "ray_network_policy_violations",
    "ALLOWED_SERVICE_TYPES", "EFA_RESOURCE", "parse_quantity", "ray_head_exposure_violations",
    "ray_worker_violations", "selects_ray_pods", "service_exposure_violations",
    "RESERVATION_TAG_KEYS", "capacity_reservation_violations", "reservation_target",
    "IAM_POLICIES", "MLFLOW_TRACKING_SERVER", "mlflow_access_violations", "tracking_server_violations",
    "BUCKET_POLICY", "BUCKETS", "CAPACITY_BLOCK", "CAPACITY_RESERVATION", "EKS_CLUSTER", "ENCRYPTION_CONFIGS",
    "HELM_CHART", "HELM_RELEASE", "INGRESS", "LAUNCH_TEMPLATE", "NAMESPACE", "NETWORK_POLICY", "NODE_GROUP",
    "PLACEMENT_GROUP", "POD_SPEC_PATHS", "PUBLIC_ACCESS_BLOCK", "RAY_CLUSTER", "SERVICE", "SUBNET", "UNKNOWN",
    "StackResource", "StackViolation",
]
