"""The node allocatable model (infra/sizing.py) against real nodes, and every GPU type's worker
against the node it must be scheduled on.

The real nodes are published `kubectl describe node` outputs of EKS GPU nodes with EFA (the
awsome-distributed-training samples): a p4de.24xlarge showed `memory: 1146004920Ki`,
`hugepages-2Mi: 21122Mi`, `cpu: 95690m`, `pods: 250`; a p5.48xlarge `memory: 2052371068Ki`,
`hugepages-2Mi: 42242Mi`.
"""

from __future__ import annotations

import dataclasses
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from ruamel.yaml import YAML

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "policy"))

from rules import parse_quantity  # noqa: E402  (quantities, read as the policy pack reads them)

from infra.config import StackConfig  # noqa: E402
from infra.health import NODE_MONITORING_AGENT, node_monitoring_agent_values  # noqa: E402
from infra.helm_values import (EFA_DEVICE_PLUGIN, NODE_TERMINATION_HANDLER, NVIDIA_DEVICE_PLUGIN,  # noqa: E402
                               chart_values)
from infra.spot import node_termination_handler_values  # noqa: E402
from infra.instance_types import GPU_INSTANCE_TYPES, INSTANCE_TYPES  # noqa: E402
from infra.raycluster import build_raycluster  # noqa: E402
from infra.sizing import (EFA_RESOURCE, GPU_NODE_DAEMONSETS, GPU_RESOURCE,  # noqa: E402
                          HUGEPAGES_RESOURCE, daemonset_requests, max_huge_pages_mib, max_pods,
                          node_allocatable)

P4DE = dataclasses.replace(INSTANCE_TYPES["p4d.24xlarge"], name="p4de.24xlarge", gpu_memory_gib=80)
PUBLISHED = [  # (instance, allocatable memory in Ki, hugepages-2Mi in Mi)
    (P4DE, 1146004920, 21122),
    (INSTANCE_TYPES["p5.48xlarge"], 2052371068, 42242),
]
BASE = StackConfig(region="eu-west-1", gpu_availability_zone="eu-west-1b",
                   gpu_availability_zone_id="euw1-az2")


@pytest.mark.parametrize(("instance", "memory_ki", "hugepages_mi"), PUBLISHED,
                         ids=[p[0].name for p in PUBLISHED])
def test_the_model_predicts_published_nodes_within_one_percent(instance, memory_ki, hugepages_mi):
    node = node_allocatable(instance)
    assert node.memory_kib == pytest.approx(memory_ki, rel=0.01)
    assert node.hugepages_2mi * 2 == hugepages_mi
    # The model may err only on the small side by more than rounding: a worker sized to it fits.
    assert node.memory_kib <= memory_ki * 1.001


def test_the_model_reproduces_the_published_p4de_cpu_and_pods():
    assert node_allocatable(P4DE).cpu_millicores == 95690
    assert max_pods(P4DE) == 250


def _worker_quantities(instance_type: str, *, hugepages_mib: int = 0) -> dict[str, Decimal]:
    """The worker container's requests as the applied RayCluster spells them."""
    cfg = dataclasses.replace(BASE, gpu_instance_type=instance_type,
                              gpu_huge_pages_mib=hugepages_mib)
    (group,) = build_raycluster(cfg)["spec"]["workerGroupSpecs"]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"]
    return {name: parse_quantity(value) for name, value in resources["requests"].items()}


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_every_gpu_type_fits_its_worker_next_to_its_daemonsets(instance_type):
    # The most huge pages a worker may ask for: every page a full EFA installation reserves.
    node = node_allocatable(INSTANCE_TYPES[instance_type])
    ds_millicores, ds_mib = daemonset_requests()
    free = {"cpu": Decimal(node.cpu_millicores - ds_millicores) / 1000,
            "memory": Decimal(node.memory_kib * 1024 - ds_mib * 2**20),
            HUGEPAGES_RESOURCE: Decimal(node.hugepages_2mi * 2 * 2**20),
            GPU_RESOURCE: Decimal(node.gpus), EFA_RESOURCE: Decimal(node.efa_interfaces)}
    asks = _worker_quantities(instance_type, hugepages_mib=max_huge_pages_mib(
        INSTANCE_TYPES[instance_type]))
    assert set(asks) == set(free)
    assert {r: (asks[r], free[r]) for r in asks if asks[r] > free[r]} == {}
    # Whole nodes: every GPU, EFA interface and huge page, and most of the memory.
    assert asks[GPU_RESOURCE] == free[GPU_RESOURCE] > 0
    assert asks[EFA_RESOURCE] == free[EFA_RESOURCE] > 0
    assert asks[HUGEPAGES_RESOURCE] == free[HUGEPAGES_RESOURCE] > 0
    assert asks["memory"] >= Decimal("0.95") * free["memory"]


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_by_default_a_worker_asks_no_huge_page_and_fits_a_node_that_reserves_none(instance_type):
    # The AL2023 NVIDIA AMI installs EFA with --minimal (no huge page reservation): its node may
    # offer hugepages-2Mi 0, and a worker asking for any would stay Pending. The model still
    # counts the full reservation against memory, so the worker's memory fits either way.
    asks = _worker_quantities(instance_type)
    assert HUGEPAGES_RESOURCE not in asks
    node = node_allocatable(INSTANCE_TYPES[instance_type])
    assert asks["memory"] < node.memory_kib * 1024


def test_a_worker_sized_by_the_old_rule_would_not_fit_a_g6_node():
    # 179Gi was asked before huge pages were counted; the node offers about 172Gi.
    node = node_allocatable(INSTANCE_TYPES["g6.12xlarge"])
    assert parse_quantity("179Gi") > node.memory_kib * 1024


def _chart_defaults(shared_dir: Path, chart: str) -> dict:
    return YAML(typ="safe").load((shared_dir / "charts" / f"{chart}.values.yaml").read_text())


@pytest.mark.parametrize("chart", [EFA_DEVICE_PLUGIN.name, NVIDIA_DEVICE_PLUGIN.name])
def test_device_plugin_requests_are_the_charts_own(shared_dir, chart):
    requests = (_chart_defaults(shared_dir, chart).get("resources") or {}).get("requests") or {}
    # The program keeps the chart's requests.
    assert "resources" not in chart_values(BASE, cluster_name="ray-eks-eu-west-1")[chart]
    (modelled,) = [d for d in GPU_NODE_DAEMONSETS if d.name == chart]
    assert modelled.cpu_millicores == parse_quantity(requests.get("cpu", 0)) * 1000
    assert modelled.memory_mib * 2**20 == parse_quantity(requests.get("memory", 0))


def test_every_daemonset_the_gpu_nodes_run_is_counted():
    # The GPU node runs the EKS add-ons, both device plugins, and the node monitoring agent with
    # its GPU health reader (infra/health.py gives dcgm-server the GPU taint's toleration).
    # On Spot stacks also the Node Termination Handler, counted on every stack at its values' requests.
    requests = {d.name: (d.cpu_millicores, d.memory_mib) for d in GPU_NODE_DAEMONSETS}
    assert set(requests) == {"aws-node", "kube-proxy", "eks-pod-identity-agent",
                             EFA_DEVICE_PLUGIN.name, NVIDIA_DEVICE_PLUGIN.name,
                             NODE_MONITORING_AGENT, "dcgm-server", NODE_TERMINATION_HANDLER.name}
    nth = node_termination_handler_values()["resources"]["requests"]
    assert requests[NODE_TERMINATION_HANDLER.name] == (
        parse_quantity(nth["cpu"]) * 1000, parse_quantity(nth["memory"]) / 2**20)
    # The add-on chart's own requests: the agent asks 10m/30Mi, dcgm-server sets none.
    assert requests[NODE_MONITORING_AGENT] == (10, 30)
    assert requests["dcgm-server"] == (0, 0)
    assert "dcgmAgent" in node_monitoring_agent_values()


def test_the_system_node_fits_the_head_the_operator_coredns_and_daemonsets(shared_dir):
    system = INSTANCE_TYPES[BASE.system_instance_type]
    node = node_allocatable(system)
    assert node.hugepages_2mi == 0  # no EFA on the system node
    head = build_raycluster(BASE)["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    # The operator chart sets limits only, so its requests default to them.
    operator = _chart_defaults(shared_dir, "kuberay-operator")["resources"]["limits"]
    coredns = [("100m", "70Mi")] * 2  # EKS's CoreDNS Deployment: two replicas
    addons = [d for d in GPU_NODE_DAEMONSETS if d.name in ("aws-node", "kube-proxy",
                                                           "eks-pod-identity-agent")]
    cpu = (parse_quantity(head["resources"]["requests"]["cpu"]) + parse_quantity(operator["cpu"])
           + sum(parse_quantity(c) for c, _ in coredns)
           + sum(Decimal(d.cpu_millicores) / 1000 for d in addons))
    memory = (parse_quantity(head["resources"]["requests"]["memory"])
              + parse_quantity(operator["memory"]) + sum(parse_quantity(m) for _, m in coredns)
              + sum(d.memory_mib * 2**20 for d in addons))
    assert cpu <= Decimal(node.cpu_millicores) / 1000
    assert memory <= node.memory_kib * 1024
