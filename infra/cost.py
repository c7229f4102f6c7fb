"""An estimate of what the stack costs per hour, busy (a job on the GPU nodes) and idle (no job:
with `gpuIdleMinutes` the GPU nodes are gone), from the dated price tables: the GPU nodes at the
stack region's On-Demand price where infra/prices.py has it, the rest at infra/instance_types.py's."""

from __future__ import annotations

from infra.config import StackConfig
from infra.instance_types import (EKS_CONTROL_PLANE_USD_PER_HOUR, GP3_USD_PER_GIB_MONTH,
                                  HOURS_PER_MONTH, INSTANCE_TYPES, MLFLOW_TRACKING_SERVER_USD_PER_HOUR,
                                  NAT_GATEWAY_USD_PER_HOUR, PRICE_TABLE_DATE, PRICE_TABLE_REGION)
from infra.prices import Price, on_demand, prices_note
from infra.nodes import SYSTEM_ROOT_VOLUME_GIB
from infra.reservation import idle_usd_per_hour

PRICES_NOTE = (f"{PRICE_TABLE_REGION} On-Demand list prices of {PRICE_TABLE_DATE}; other regions "
               "differ by up to ~30%")


def gpu_node_usd_per_hour(cfg: StackConfig) -> float:
    """One GPU node's price per hour: on Spot, the price the probe read in the chosen AZ (Spot
    prices move; it is what they were then); otherwise, and on Spot without a price read, the
    On-Demand list price in the stack's region (on Spot, an upper bound: EC2 never charges more); 0
    for a type with no On-Demand list price (its Capacity Block is paid up front, and `_gpu_label`
    says so)."""
    if cfg.is_spot and cfg.gpu_spot_price_usd_per_hour:
        return float(cfg.gpu_spot_price_usd_per_hour)
    return _gpu_on_demand(cfg).usd_per_hour or 0.0


def _gpu_on_demand(cfg: StackConfig) -> Price:
    return on_demand(cfg.gpu_instance_type, cfg.region)


def stack_prices_note(cfg: StackConfig) -> str:
    """Where the stack's estimate takes its prices from."""
    return prices_note(cfg.region, gpu=_gpu_on_demand(cfg))


def _gpu_label(cfg: StackConfig) -> str:
    label = f"{cfg.gpu_node_count}x {cfg.gpu_instance_type}"
    if _gpu_on_demand(cfg).usd_per_hour is None and not cfg.gpu_spot_price_usd_per_hour:
        return f"{label} (no On-Demand list price: its Capacity Block's fee, paid up front, is not counted)"
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
    """The sum of `cost_items`, rounded to cents: the stack with its GPU nodes up."""
    return round(sum(cost_items(cfg).values()), 2)


def idle_cost_items(cfg: StackConfig) -> dict[str, float]:
    """USD per hour of each part while no job runs. Without `gpuIdleMinutes` that is every part of
    `cost_items`. With it the GPU nodes and their root volumes are gone (deleted on termination),
    and what remains is the system nodes, their volumes, the control plane, the NAT gateway, and
    a targeted On-Demand Capacity Reservation, billed by the hour whether a node uses it or not
    (a Capacity Block was paid up front, so it costs nothing more while idle)."""
    if not cfg.gpu_idle_minutes:
        return cost_items(cfg)
    volumes_gib = cfg.system_node_count * SYSTEM_ROOT_VOLUME_GIB
    items = {
        f"{cfg.system_node_count}x {cfg.system_instance_type}":
            cfg.system_node_count * cfg.system_instance.usd_per_hour,
        "EKS control plane": EKS_CONTROL_PLANE_USD_PER_HOUR,
        "NAT gateway": NAT_GATEWAY_USD_PER_HOUR,
        f"{volumes_gib} GiB gp3": volumes_gib * GP3_USD_PER_GIB_MONTH / HOURS_PER_MONTH,
    }
    reservation = cfg.gpu_reservation
    if reservation is not None and not reservation.is_capacity_block:
        items[f"reservation {reservation.reservation_id} (idle, still billed)"] = idle_usd_per_hour(cfg)
    return items


def estimated_idle_cost_per_hour(cfg: StackConfig) -> float:
    """The sum of `idle_cost_items`, rounded to cents."""
    return round(sum(idle_cost_items(cfg).values()), 2)


def reservation_idle_note(cfg: StackConfig) -> str:
    """What a targeted reservation costs while the GPU nodes are scaled to zero ("" without
    either)."""
    reservation = cfg.gpu_reservation
    if reservation is None or not cfg.gpu_idle_minutes:
        return ""
    if reservation.is_capacity_block:
        return (f"Capacity Block {reservation.reservation_id} was paid up front: scaling to zero "
                "saves none of it")
    return (f"idle still pays On-Demand Capacity Reservation {reservation.reservation_id}, "
            f"{_usd(idle_usd_per_hour(cfg))}/hour whether a node uses it or not (cancel it with "
            "`python -m capacity release` to stop that)")


def _usd(amount: float) -> str:
    return f"${amount:,.2f}" if amount >= 0.1 else f"${amount:.3f}"


def cost_summary(cfg: StackConfig) -> str:
    """One line: the stack's hourly estimate and what it is made of; with `gpuIdleMinutes`, busy
    and idle."""
    items = ", ".join(f"{name} {_usd(usd)}" for name, usd in cost_items(cfg).items())
    if not cfg.gpu_idle_minutes:
        return (f"estimated cost while it runs: about {_usd(estimated_cost_per_hour(cfg))}/hour "
                f"({items}; {stack_prices_note(cfg)}; data transfer and S3 not included)")
    idle = ", ".join(f"{name} {_usd(usd)}" for name, usd in idle_cost_items(cfg).items())
    note = reservation_idle_note(cfg)
    return (f"estimated cost: about {_usd(estimated_cost_per_hour(cfg))}/hour busy ({items}), "
            f"{_usd(estimated_idle_cost_per_hour(cfg))}/hour idle, the GPU nodes scaled to zero "
            f"{cfg.gpu_idle_minutes} min after the last job ({idle}{'; ' + note if note else ''}); "
            f"{stack_prices_note(cfg)}; data transfer and S3 not included")


def gpu_nodes_cost_note(instance_type: str, count: int, *, spot_usd_per_hour: float | None = None) -> str:
    """What the GPU nodes of a placement cost per hour, for the probe's placement line; with a
    Spot price, beside the On-Demand list price."""
    list_price = INSTANCE_TYPES[instance_type].usd_per_hour
    if list_price is None:
        return (f"{instance_type} has no On-Demand list price ({PRICES_NOTE}): EC2 sells it as "
                "Capacity Blocks (`python -m capacity blocks` shows their price)")
    on_demand = count * list_price
    if spot_usd_per_hour is None:
        return f"the GPU nodes cost about {_usd(on_demand)}/hour ({PRICES_NOTE})"
    spot = count * spot_usd_per_hour
    saving = 1 - spot / on_demand if on_demand else 0.0
    return (f"the GPU nodes cost about {_usd(spot)}/hour on Spot at EC2's latest price there, "
            f"{saving:.0%} below the {_usd(on_demand)}/hour On-Demand list price ({PRICES_NOTE}); "
            "Spot prices move")
