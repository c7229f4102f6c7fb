"""On-Demand list prices by region, for the regions the capacity probe tries first.

`python -m infra render`, the stack's `estimatedCostPerHourUsd` and its idle cost price a stack in
its own region: the GPU instance types' On-Demand Linux prices (USD/hour) as EC2 published them on
PRICES_DATE for each region of the probe's default list (capacity/cli.py's DEFAULT_REGIONS), where
the type is offered there. What this table lacks (another region, a type not offered there, the
types of NOT_PRICED_BY_REGION, the system nodes, the NAT gateway and gp3, which it does not carry) is
priced from infra/instance_types.py's us-east-1 list, and the estimate says so: other regions differ by
up to ~30%. A type with no On-Demand list price there (p5e) has none here either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from infra.instance_types import INSTANCE_TYPES, PRICE_TABLE_DATE, PRICE_TABLE_REGION

PRICES_DATE = "2026-01-21"

ON_DEMAND_USD_PER_HOUR: dict[str, dict[str, float]] = {
    "us-east-1": {"g6.12xlarge": 4.6016, "g6e.12xlarge": 10.49264, "g5.12xlarge": 5.672, "p4d.24xlarge": 21.957642,
                  "p5.48xlarge": 55.04},
    "us-east-2": {"g6.12xlarge": 4.6016, "g6e.12xlarge": 10.49264, "g5.12xlarge": 5.672, "p4d.24xlarge": 21.95764,
                  "p5.48xlarge": 55.04},
    "us-west-2": {"g6.12xlarge": 4.6016, "g6e.12xlarge": 10.49264, "g5.12xlarge": 5.672, "p4d.24xlarge": 21.95764,
                  "p5.48xlarge": 55.04},
    "eu-west-1": {"g5.12xlarge": 6.33167, "p4d.24xlarge": 23.71569},
    "eu-central-1": {"g6.12xlarge": 5.75429, "g6e.12xlarge": 13.12002, "g5.12xlarge": 7.09282,
                     "p4d.24xlarge": 27.43298},
    "ap-northeast-1": {"g6.12xlarge": 6.67369, "g6e.12xlarge": 15.21742, "g5.12xlarge": 8.22609,
                       "p4d.24xlarge": 30.09784, "p5.48xlarge": 68.8},
}
"""Region -> instance type -> On-Demand Linux USD/hour on PRICES_DATE. A type missing from a region's
row (and not in NOT_PRICED_BY_REGION) was not offered there then (eu-west-1 had no G6, G6e or P5;
eu-central-1 no P5)."""

NOT_PRICED_BY_REGION = ("p5e.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge")
"""GPU types of infra/instance_types.py this table has no regional prices for: p5en and p6-b200 are
priced at their us-east-1 list price in every region; p5e has no On-Demand price (EC2 sells it as
Capacity Blocks)."""


@dataclass(frozen=True, kw_only=True)
class Price:
    instance_type: str
    usd_per_hour: Optional[float]
    """None where EC2 lists no On-Demand price for the type (p5e: Capacity Blocks only)."""
    region: str
    """The region whose price it is: the stack's, or the fallback table's."""
    date: str

    def regional(self, region: str) -> bool:
        return self.region == region


def on_demand(instance_type: str, region: str) -> Price:
    """The On-Demand price of `instance_type` in `region`: this table's, else infra/instance_types.py's
    us-east-1 list price (the caller says which it got: `Price.region`)."""
    usd = ON_DEMAND_USD_PER_HOUR.get(region, {}).get(instance_type)
    if usd is not None:
        return Price(instance_type=instance_type, usd_per_hour=usd, region=region, date=PRICES_DATE)
    return Price(instance_type=instance_type, usd_per_hour=INSTANCE_TYPES[instance_type].usd_per_hour,
                 region=PRICE_TABLE_REGION, date=PRICE_TABLE_DATE)


def prices_note(region: str, *, gpu: Price) -> str:
    """Where the estimate's prices come from, in one clause."""
    fallback = f"{PRICE_TABLE_REGION} list prices of {PRICE_TABLE_DATE}"
    if gpu.regional(region):
        return (f"GPU nodes at {region}'s On-Demand list price of {gpu.date}, the rest at {fallback} (the table has "
                f"no {region} price for them; other regions differ by up to ~30%)" if region != PRICE_TABLE_REGION
                else f"{region} On-Demand list prices of {gpu.date} (GPU nodes) and {PRICE_TABLE_DATE}")
    if gpu.usd_per_hour is None:  # the GPU nodes' line says they have no On-Demand price
        return f"the rest at {fallback}; other regions differ by up to ~30%"
    if gpu.instance_type in NOT_PRICED_BY_REGION:
        why = f"the regional table has no price for {gpu.instance_type}"
    elif region in ON_DEMAND_USD_PER_HOUR:
        why = f"{gpu.instance_type} was not offered in {region} on {PRICES_DATE}"
    else:
        known = ", ".join(sorted(ON_DEMAND_USD_PER_HOUR))
        why = f"the table has no {region} price for the GPU instance type (it prices {known})"
    return f"{fallback}: {why}; other regions differ by up to ~30%"
