"""GPU node groups: the GPU label and taint, a launch template with EFA interfaces and a cluster
placement group."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from .reservations import reservation_target
from .resources import (LAUNCH_TEMPLATE, NODE_GROUP, PLACEMENT_GROUP, UNKNOWN, StackResource, StackViolation,
                        as_list, referenced, value_at)

GPU_LABEL_KEY = "nvidia.com/gpu.present"
GPU_LABEL_VALUE = "true"
GPU_TAINT_KEY = "nvidia.com/gpu"
PRIMARY_INTERFACE_TYPES = ("efa", "interface")
"""The primary interface carries the node's IP: EFA with ENA, or plain ENA beside `efa-only`
interfaces (AWS's layout for instances with several network cards)."""

_GPU_AMI_RE = re.compile(r"NVIDIA|GPU", re.IGNORECASE)
_GPU_INSTANCE_RE = re.compile(r"^(g|p)\d")


def is_gpu_node_group(props: Mapping[str, Any]) -> bool:
    """A node group is a GPU group when its AMI type is a GPU one or an instance type is g*/p*."""
    ami = props.get("amiType")
    if isinstance(ami, str) and _GPU_AMI_RE.search(ami):
        return True
    return any(isinstance(t, str) and _GPU_INSTANCE_RE.match(t)
               for t in as_list(props.get("instanceTypes")))


def gpu_node_group_violations(props: Mapping[str, Any]) -> list[str]:
    """The GPU label, the GPU taint and a launch template on a GPU managed node group."""
    if not is_gpu_node_group(props):
        return []
    out: list[str] = []
    labels = props.get("labels")
    if labels is not UNKNOWN:
        value = value_at(labels, GPU_LABEL_KEY)
        if value is not UNKNOWN and value != GPU_LABEL_VALUE:
            out.append(f"GPU node group lacks the label {GPU_LABEL_KEY}={GPU_LABEL_VALUE} (has "
                       f"{value!r}): the NVIDIA device plugin DaemonSet selects nodes by it and "
                       "otherwise lands on none, silently")
    taints = props.get("taints")
    if taints is not UNKNOWN and not any(
            value_at(t, "key") in (GPU_TAINT_KEY, UNKNOWN) for t in as_list(taints)):
        out.append(f"GPU node group has no {GPU_TAINT_KEY} taint: pods that need no GPU would be "
                   "scheduled onto GPU nodes")
    if props.get("launchTemplate") is None:
        out.append("GPU node group has no launch template: EFA interfaces and the cluster "
                   "placement group of a managed node group come only through one")
    return out


def efa_launch_template_violations(template: Mapping[str, Any],
                                   placement_groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """EFA interfaces and a cluster placement group in a GPU node group's launch template.

    `placement_groups` are the PlacementGroup resources the template's `placement` refers to.
    """
    out: list[str] = []
    interfaces = template.get("networkInterfaces")
    if interfaces is not UNKNOWN:
        types = [value_at(ni, "interfaceType") for ni in as_list(interfaces)]
        if UNKNOWN not in types:
            if not any(t in ("efa", "efa-only") for t in types):
                out.append("launch template of a GPU node group has no EFA network interface "
                           "(interfaceType efa): NCCL would fall back to TCP sockets")
            else:
                primary = _primary_interface(as_list(interfaces))
                kind = value_at(primary, "interfaceType")
                if primary is not None and kind not in PRIMARY_INTERFACE_TYPES:
                    out.append("the primary network interface (card 0, device 0) must have "
                               "interfaceType efa or interface (ENA), not "
                               f"{kind!r}: it carries the node's IP")
    group_name = value_at(template, "placement", "groupName")
    if reservation_target(template) is not None:
        if group_name not in (None, "", UNKNOWN):
            out.append("launch template targets a capacity reservation and also sets a placement "
                       "group: instances in a placement group only draw on reservations made in "
                       "it, so they would fail with InsufficientInstanceCapacity")
    elif group_name is None or group_name == "":
        out.append("launch template of a GPU node group sets no placement group: EFA traffic "
                   "between nodes needs a cluster placement group")
    for group in placement_groups:
        strategy = group.get("strategy")
        if strategy is not UNKNOWN and strategy != "cluster":
            out.append(f"placement group strategy is {strategy!r}, not 'cluster'")
    return out


def _primary_interface(interfaces: list[Any]) -> Any:
    for ni in interfaces:
        card, device = value_at(ni, "networkCardIndex"), value_at(ni, "deviceIndex")
        if card in (None, 0) and device in (None, 0):
            return ni
    return None


def gpu_node_group_efa_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """Every GPU node group's launch template has EFA interfaces and a cluster placement group."""
    templates = [r for r in resources if r.type == LAUNCH_TEMPLATE]
    groups = [r for r in resources if r.type == PLACEMENT_GROUP]
    out: list[StackViolation] = []
    for ng in resources:
        if ng.type != NODE_GROUP or not is_gpu_node_group(ng.props):
            continue
        if ng.props.get("launchTemplate") is None:
            continue  # reported by gpu_node_group_violations on the node group itself
        linked = referenced(ng, "launchTemplate", templates, ("id", "name"))
        if not linked:
            out.append(StackViolation(ng.urn, "GPU node group's launch template is not part of "
                                      "this stack, so its EFA setup cannot be checked"))
            continue
        for lt in linked:
            pgs = referenced(lt, "placement", groups, ("name", "id"))
            out.extend(StackViolation(lt.urn, m)
                       for m in efa_launch_template_violations(lt.props, [g.props for g in pgs]))
    return out
