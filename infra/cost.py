"""An estimate of what the stack costs per hour while it runs, from the dated price table."""

from __future__ import annotations

from infra.config import StackConfig
from infra.instance_types import (EKS_CONTROL_PLANE_USD_PER_HOUR, GP3_USD_PER_GIB_MONTH,
                                  HOURS_PER_MONTH, NAT_GATEWAY_USD_PER_HOUR)
from infra.nodes import SYSTEM_ROOT_VOLUME_GIB


def estimated_cost_per_hour(cfg: StackConfig) -> float:
    """USD per hour at the table's On-Demand list prices: GPU nodes, system nodes, their root
    volumes, the EKS control plane and the NAT gateway (data transfer and S3 not included)."""
    nodes = (cfg.gpu_node_count * cfg.gpu_instance.usd_per_hour
             + cfg.system_node_count * cfg.system_instance.usd_per_hour)
    volumes_gib = (cfg.gpu_node_count * cfg.gpu_root_volume_gib
                   + cfg.system_node_count * SYSTEM_ROOT_VOLUME_GIB)
    volumes = volumes_gib * GP3_USD_PER_GIB_MONTH / HOURS_PER_MONTH
    return round(nodes + volumes + EKS_CONTROL_PLANE_USD_PER_HOUR + NAT_GATEWAY_USD_PER_HOUR, 2)
