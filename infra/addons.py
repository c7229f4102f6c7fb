"""The cluster add-ons, through Helm at pinned chart versions: the NVIDIA and EFA device plugins,
the KubeRay operator, and on Spot stacks the AWS Node Termination Handler. Their values come from
infra/helm_values.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import pulumi
import pulumi_kubernetes as k8s

from infra.helm_values import (EFA_DEVICE_PLUGIN, KUBERAY_OPERATOR, NODE_TERMINATION_HANDLER,
                               NVIDIA_DEVICE_PLUGIN, Chart)


@dataclass(frozen=True, kw_only=True)
class AddonsArgs:
    provider: k8s.Provider
    values: Mapping[str, Mapping[str, Any]]
    """Helm values by chart name (infra.helm_values.chart_values)."""
    versions: Mapping[str, str]
    """Chart version by chart name (infra.helm_values.chart_versions)."""
    system_nodes: pulumi.Resource
    """The operator's release waits for the system nodes it runs on, and for nothing else: a GPU
    capacity failure must not hold back the operator."""
    gpu_nodes: pulumi.Resource
    """The device plugins' (and the termination handler's) releases wait for the GPU nodes their
    DaemonSets run on."""


class Addons(pulumi.ComponentResource):
    """Three Helm releases, and the termination handler's where `values` has it (Spot)."""

    def __init__(self, name: str, args: AddonsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("ray-eks:infra:Addons", name, None, opts)
        self.nvidia_device_plugin = self._release(name, NVIDIA_DEVICE_PLUGIN, args,
                                                  after=args.gpu_nodes)
        self.efa_device_plugin = self._release(name, EFA_DEVICE_PLUGIN, args, after=args.gpu_nodes)
        self.kuberay_operator = self._release(name, KUBERAY_OPERATOR, args,
                                              after=args.system_nodes)
        self.node_termination_handler = (
            self._release(name, NODE_TERMINATION_HANDLER, args, after=args.gpu_nodes)
            if NODE_TERMINATION_HANDLER.name in args.values else None)
        self.register_outputs({"kuberayOperator": self.kuberay_operator.status})

    def _release(self, name: str, chart: Chart, args: AddonsArgs, *,
                 after: pulumi.Resource) -> k8s.helm.v3.Release:
        return k8s.helm.v3.Release(
            f"{name}-{chart.name}",
            name=chart.name,
            chart=chart.name,
            version=args.versions[chart.name],
            repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=chart.repository),
            namespace=chart.namespace,
            create_namespace=True,
            values=dict(args.values[chart.name]),
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider,
                                        depends_on=[after]))
