"""The rules of a targeted capacity reservation: its keys all set or all unset, and agreeing with the
GPU placement (instance type, AZ, node count)."""

from __future__ import annotations

import re
from typing import Iterator

from infra.config.errors import ConfigError, fix_cmd
from infra.config.schema import RESERVATION_FIELDS, RESERVATION_KINDS, StackConfig, config_key, parse_utc
from infra.instance_types import INSTANCE_TYPES, sells_capacity_blocks

_RESERVATION_ID_RE = re.compile(r"^cr-[0-9a-f]{8,17}$")


def reservation_problems(cfg: StackConfig) -> Iterator[ConfigError]:
    """The reservation keys are all set or all unset, and agree with the GPU placement: the first
    problem only, since each check assumes the ones before it passed."""
    first = next(_reservation_checks(cfg), None)
    if first is not None:
        yield first


def _reservation_checks(cfg: StackConfig) -> Iterator[ConfigError]:
    k = config_key
    release = "or run `python -m capacity release --stack <stack>` to stop targeting it"
    set_fields = [name for name in RESERVATION_FIELDS[1:] if getattr(cfg, name)]
    if not cfg.gpu_reservation_id:
        if set_fields:
            yield ConfigError(k(set_fields[0]), getattr(cfg, set_fields[0]),
                              f"is set without {k('gpu_reservation_id')}",
                              "remove the ray-eks:gpuReservation* keys, or let `python -m "
                              "capacity probe --hold` or `python -m capacity blocks` write them")
        return
    if not _RESERVATION_ID_RE.match(cfg.gpu_reservation_id):
        yield ConfigError(k("gpu_reservation_id"), cfg.gpu_reservation_id,
                          "is not a capacity reservation ID like cr-0123456789abcdef0",
                          "let `python -m capacity probe --hold` or `python -m capacity blocks` "
                          "write it")
    missing = [name for name in RESERVATION_FIELDS[1:] if not getattr(cfg, name)]
    if missing:
        yield ConfigError(k(missing[0]), None, f"is required with {k('gpu_reservation_id')}",
                          "let `python -m capacity probe --hold` or `python -m capacity blocks` "
                          "write every ray-eks:gpuReservation* key")
    if cfg.gpu_reservation_type not in RESERVATION_KINDS:
        yield ConfigError(k("gpu_reservation_type"), cfg.gpu_reservation_type,
                          f"must be one of {', '.join(RESERVATION_KINDS)}",
                          fix_cmd(k("gpu_reservation_type"), RESERVATION_KINDS[0]))
    for name in ("gpu_reservation_start", "gpu_reservation_end"):
        try:
            parse_utc(getattr(cfg, name))
        except ValueError:
            yield ConfigError(k(name), getattr(cfg, name), "is not an ISO 8601 time in UTC",
                              "write it like 2026-12-03T11:30:00Z")
    if parse_utc(cfg.gpu_reservation_end) <= parse_utc(cfg.gpu_reservation_start):
        yield ConfigError(k("gpu_reservation_end"), cfg.gpu_reservation_end,
                          f"is not after {k('gpu_reservation_start')} "
                          f"({cfg.gpu_reservation_start})",
                          "write the times EC2 reports for the reservation")
    if cfg.gpu_reservation_instance_type not in INSTANCE_TYPES:
        yield ConfigError(k("gpu_reservation_instance_type"), cfg.gpu_reservation_instance_type,
                          "is not an instance type of infra/instance_types.py",
                          "write the type EC2 reports for the reservation")
    if not cfg.gpu_reservation_availability_zone.startswith(cfg.region) or not re.fullmatch(
            r"[a-z]", cfg.gpu_reservation_availability_zone[len(cfg.region):] or "-"):
        yield ConfigError(k("gpu_reservation_availability_zone"),
                          cfg.gpu_reservation_availability_zone,
                          f"is not an availability zone of {cfg.region}",
                          "write the AZ EC2 reports for the reservation")
    if cfg.gpu_reservation_instance_count < 1:
        yield ConfigError(k("gpu_reservation_instance_count"),
                          cfg.gpu_reservation_instance_count, "must be at least 1",
                          "write the instance count EC2 reports for the reservation")
    owner = f"reservation {cfg.gpu_reservation_id}"
    if cfg.gpu_instance_type != cfg.gpu_reservation_instance_type:
        yield ConfigError(k("gpu_instance_type"), cfg.gpu_instance_type,
                          f"differs from {owner}'s instance type "
                          f"{cfg.gpu_reservation_instance_type}: no instance could launch into it",
                          f"set it back to {cfg.gpu_reservation_instance_type}, {release}")
    if cfg.gpu_availability_zone != cfg.gpu_reservation_availability_zone:
        yield ConfigError(k("gpu_availability_zone"), cfg.gpu_availability_zone,
                          f"differs from {owner}'s AZ {cfg.gpu_reservation_availability_zone}",
                          f"set it back to {cfg.gpu_reservation_availability_zone}, {release}")
    if cfg.gpu_node_count > cfg.gpu_reservation_instance_count:
        yield ConfigError(k("gpu_node_count"), cfg.gpu_node_count,
                          f"exceeds the {cfg.gpu_reservation_instance_count} instances "
                          f"{owner} holds",
                          f"set it to at most {cfg.gpu_reservation_instance_count}, {release}")
    if (cfg.gpu_reservation_type == "capacity-block"
            and not sells_capacity_blocks(cfg.gpu_reservation_instance_type)):
        yield ConfigError(k("gpu_reservation_type"), cfg.gpu_reservation_type,
                          f"EC2 sells no Capacity Blocks for {cfg.gpu_reservation_instance_type}",
                          "write the type EC2 reports for the reservation (on-demand for an ODCR)")
