"""The Kubernetes objects of a stack as plain data: what `pulumi up` hands to the RayCluster
resource and the Helm releases, computed from the stack file alone."""

from __future__ import annotations

import io
from typing import Any

from ruamel.yaml import YAML

from infra.config import PROJECT, StackConfig
from infra.helm_values import chart_values, chart_versions
from infra.raycluster import build_raycluster


def cluster_name(stack: str) -> str:
    """The EKS cluster's name in a stack: `<project>-<stack>`, as the program names it."""
    return f"{PROJECT}-{stack}"


def rendered_objects(cfg: StackConfig, *, stack: str) -> dict[str, Any]:
    """The RayCluster manifest and, per chart, its version and values."""
    versions = chart_versions(cfg)
    return {
        "raycluster": build_raycluster(cfg),
        "helm": {chart: {"version": versions[chart], "values": values}
                 for chart, values in chart_values(cfg, cluster_name=cluster_name(stack)).items()},
    }


def render_yaml(cfg: StackConfig, *, stack: str) -> str:
    """A multi-document YAML: the RayCluster, then one document of values per Helm chart."""
    objects = rendered_objects(cfg, stack=stack)
    yaml = YAML()
    yaml.default_flow_style = False
    yaml.width = 4096
    out = io.StringIO()
    out.write(f"# RayCluster applied by `pulumi up` (stack region {cfg.region})\n")
    yaml.dump(objects["raycluster"], out)
    for chart, release in objects["helm"].items():
        out.write(f"---\n# Helm values of {chart} {release['version']}\n")
        yaml.dump(release["values"] or {}, out)
    return out.getvalue()
