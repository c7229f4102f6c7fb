"""An estimate of what the stack costs per hour while it runs, from the dated price table."""

from __future__ import annotations

from infra.config import StackConfig
from infra.instance_types import (EKS_CONTROL_PLANE_USD_PER_HOUR, GP3_USD_PER_GIB_MONTH,
                                  HOURS_PER_MONTH, INSTANCE_TYPES, MLFLOW_TRACKING_SERVER_USD_PER_HOUR,
                                  NAT_GATEWAY_USD_PER_HOUR, PRICE_TABLE_DATE, PRICE_TABLE_REGION)
from infra.nodes import SYSTEM_ROOT_VOLUME_GIB

PRICES_NOTE = (f"{PRICE_TABLE_REGION} On-Demand list prices of {PRICE_TABLE_DATE}; other regions "
               "differ by up to ~30%")


def gpu_node_usd_per_hour(cfg: StackConfig) -> float:
    """One GPU node's price per hour: on Spot, the price the probe read in the chosen AZ (Spot
    prices move; it is what they were then); otherwise, and on Spot without a price read, the
    table's On-Demand list price (on Spot, an upper bound: EC2 never charges more)."""
    if cfg.is_spot and cfg.gpu_spot_price_usd_per_hour:
        return float(cfg.gpu_spot_price_usd_per_hour)
    return cfg.gpu_instance.usd_per_hour


def _gpu_label(cfg: StackConfig) -> str:
    label = f"{cfg.gpu_node_count}x {cfg.gpu_instance_type}"
    if not cfg.is_spot:
        return label
    if cfg.gpu_spot_price_usd_per_hour:
        return f"{label} Spot (the probe's price)"
    return f"{label} Spot (at most the On-Demand price: no Spot price read)"


def cost_items(cfg: StackConfig) -> dict[str, float]:
    """USD per hour of each part at the table's On-Demand list prices (the GPU nodes on Spot at
    the price the probe read): GPU nodes, system nodes, their root volumes, the EKS control plane,
    the NAT gateway and, with `ray-eks:mlflow`, the MLflow tracking server (data transfer and S3
    not included)."""
    volumes_gib = (cfg.gpu_node_count * cfg.gpu_root_volume_gib
                   + cfg.system_node_count * SYSTEM_ROOT_VOLUME_GIB)
    tracking = ({f"MLflow tracking server ({cfg.mlflow_size})": MLFLOW_TRACKING_SERVER_USD_PER_HOUR[cfg.mlflow_size]}
                if cfg.mlflow else {})
    return {
        _gpu_label(cfg): cfg.gpu_node_count * gpu_node_usd_per_hour(cfg),
        f"{cfg.system_node_count}x {cfg.system_instance_type}":
            cfg.system_node_count * cfg.system_instance.usd_per_hour,
        "EKS control plane": EKS_CONTROL_PLANE_USD_PER_HOUR,
        "NAT gateway": NAT_GATEWAY_USD_PER_HOUR,
        f"{volumes_gib} GiB gp3": volumes_gib * GP3_USD_PER_GIB_MONTH / HOURS_PER_MONTH,
        **tracking,
    }


def estimated_cost_per_hour(cfg: StackConfig) -> float:
    """The sum of `cost_items`, rounded to cents."""
    return round(sum(cost_items(cfg).values()), 2)


def _usd(amount: float) -> str:
    return f"${amount:,.2f}" if amount >= 0.1 else f"${amount:.3f}"


def cost_summary(cfg: StackConfig) -> str:
    """One line: the stack's hourly estimate and what it is made of."""
    items = ", ".join(f"{name} {_usd(usd)}" for name, usd in cost_items(cfg).items())
    return (f"estimated cost while it runs: about {_usd(estimated_cost_per_hour(cfg))}/hour "
            f"({items}; {PRICES_NOTE}; data transfer and S3 not included)")


def gpu_nodes_cost_note(instance_type: str, count: int, *, spot_usd_per_hour: float | None = None) -> str:
    """What the GPU nodes of a placement cost per hour, for the probe's placement line; with a
    Spot price, beside the On-Demand list price."""
    on_demand = count * INSTANCE_TYPES[instance_type].usd_per_hour
    if spot_usd_per_hour is None:
        return f"the GPU nodes cost about {_usd(on_demand)}/hour ({PRICES_NOTE})"
    spot = count * spot_usd_per_hour
    saving = 1 - spot / on_demand if on_demand else 0.0
    return (f"the GPU nodes cost about {_usd(spot)}/hour on Spot at EC2's latest price there, "
            f"{saving:.0%} below the {_usd(on_demand)}/hour On-Demand list price ({PRICES_NOTE}); "
            "Spot prices move")
