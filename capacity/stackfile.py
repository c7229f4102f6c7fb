"""Write the probe's choice into `Pulumi.<stack>.yaml`, changing nothing else.

The file is edited as infra/config/stack_edit.py edits stack files (a faithful ruamel.yaml round trip,
then a line diff that lets only the edited keys change): here the GPU placement keys, and the
reservation keys of `--hold`, `blocks` and `release`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap

from capacity.probe import Placement
from infra.config import (PLACEMENT_FIELDS, RESERVATION_FIELDS, SPOT_FIELDS, ConfigError, GpuReservation,
                          StackConfig, check_stack_file_settings, coerce_values, config_key, format_utc,
                          located, parse_stack_config, read_stack_values)
from infra.config.stack_edit import (LAYOUTS, StackFileError, StackUpdate, check_only_keys_changed, dump,
                                     faithful_load, round_trip_yaml)
from infra.config.stack_edit import write as write  # the capacity commands write through this module

PLACEMENT_KEYS = tuple(config_key(name) for name in PLACEMENT_FIELDS)
RESERVATION_KEYS = tuple(config_key(name) for name in RESERVATION_FIELDS)
SPOT_KEYS = tuple(config_key(name) for name in SPOT_FIELDS)
MANAGED_KEYS = PLACEMENT_KEYS + SPOT_KEYS + RESERVATION_KEYS
"""Every key the capacity commands write, in the order they are inserted."""

_HEADER = ("# GPU placement written by `python -m capacity probe`; it rewrites only the placement\n"
           "# keys and keeps every other key and comment you add here.\n")


def placement_values(placement: Placement) -> dict[str, Any]:
    """The stack-file keys the probe owns, with the placement's values; on Spot also the capacity
    type and the Spot price read in the zone (`spot_keys_removed` says what an On-Demand
    placement removes)."""
    values = dict(zip(PLACEMENT_KEYS, (placement.region, placement.zone, placement.zone_id,
                                       placement.instance_type, placement.node_count)))
    if placement.capacity_type == "spot":
        price = placement.spot_usd_per_hour
        values.update(zip(SPOT_KEYS, ("spot", "" if price is None else f"{price:.4f}")))
        if price is None:
            del values[SPOT_KEYS[1]]
    return values


def spot_keys_removed(placement: Placement) -> tuple[str, ...]:
    """The Spot keys a placement takes out of the stack file: all of them for On-Demand (its
    default), the price for Spot when none was read (an old price would be taken for today's)."""
    if placement.capacity_type != "spot":
        return SPOT_KEYS
    return () if placement.spot_usd_per_hour is not None else SPOT_KEYS[1:]


def read_region(path: Path) -> str | None:
    """`aws:region` of an existing stack file (None when absent); ConfigError when malformed."""
    if not path.exists():
        return None
    region = read_stack_values(path).get(config_key("region"))
    return str(region) if region else None


def read_zone_id(path: Path) -> str:
    if not path.exists():
        return ""
    return str(read_stack_values(path).get(config_key("gpu_availability_zone_id")) or "")


@dataclass(frozen=True, kw_only=True)
class GpuNodes:
    """The GPU nodes a stack deploys now."""

    instance_type: str
    """Its gpuInstanceType (the schema's default when the file leaves it out)."""
    node_count: int
    """Its gpuNodeCount (likewise)."""
    instance_type_set: bool
    """The file names the type itself (rather than leaving it to the default)."""


def read_gpu_nodes(path: Path) -> GpuNodes | None:
    """The GPU instance type and node count of an existing stack file, None without one;
    ConfigError (with its line) when either value has the wrong type."""
    if not path.exists():
        return None
    names = ("gpu_instance_type", "gpu_node_count")
    values = read_stack_values(path)
    typed, errors = coerce_values(values)
    bad = [e for e in errors if e.key in {config_key(n) for n in names}]
    if bad:
        raise located(bad[0], path)
    defaults = {f.name: f.default for f in dataclasses.fields(StackConfig) if f.name in names}
    return GpuNodes(instance_type=typed.get(names[0], defaults[names[0]]),
                    node_count=typed.get(names[1], defaults[names[1]]),
                    instance_type_set=config_key(names[0]) in values)


def reservation_values(reservation: GpuReservation) -> dict[str, Any]:
    """The reservation keys with the reservation's values."""
    return dict(zip(RESERVATION_KEYS, (
        reservation.reservation_id, reservation.kind, reservation.instance_type,
        reservation.availability_zone, reservation.instance_count, format_utc(reservation.start),
        format_utc(reservation.end))))


def read_reservation(path: Path) -> dict[str, Any]:
    """The reservation keys an existing stack file sets (empty when it targets none)."""
    if not path.exists():
        return {}
    values = read_stack_values(path)
    if not values.get(RESERVATION_KEYS[0]):
        return {}
    return {key: values[key] for key in RESERVATION_KEYS if key in values}


def _faithful_yaml(text: str, path: Path) -> tuple[YAML, Any]:
    return faithful_load(text, path, keys=PLACEMENT_KEYS)


def _by_hand(values: Mapping[str, Any], remove: tuple[str, ...]) -> str:
    sets = ", ".join(f"{k}: {v}" for k, v in values.items())
    return f"set {sets} by hand" + (f" and remove {', '.join(remove)}" if remove else "")


def _set_placement(config: CommentedMap, values: Mapping[str, Any]) -> None:
    """Replace existing keys in place; insert missing ones after the managed key before them."""
    for i, key in enumerate(MANAGED_KEYS):
        if key not in values:
            continue
        if key in config:
            config[key] = values[key]
            continue
        earlier = [k for k in MANAGED_KEYS[:i] if k in config]
        pos = list(config).index(earlier[-1]) + 1 if earlier else 0
        config.insert(pos, key, values[key])


def _check_only_placement_changed(before: str, after: str, path: Path, fix: str) -> None:
    check_only_keys_changed(before, after, path, keys=MANAGED_KEYS, fix=fix)


def _parses(text: str) -> ConfigError | None:
    values = (YAML(typ="safe").load(text) or {}).get("config") or {}
    try:
        parse_stack_config(values)
    except ConfigError as exc:
        return exc
    return None


def precheck(path: Path) -> None:
    """Fail now, before any cloud call, if an existing stack file could not be updated later or
    holds a bad value in a key the probe keeps."""
    if not path.exists():
        return
    check_stack_file_settings(path)
    text = path.read_text()
    if round_trip_yaml(LAYOUTS[0]).load(text) is not None:
        _faithful_yaml(text, path)


def plan_update(path: Path, values: Mapping[str, Any], *,
                remove: tuple[str, ...] = ()) -> StackUpdate:
    """The new text of the stack file with `values` set and the keys in `remove` gone (both among
    MANAGED_KEYS). ConfigError when the existing file is malformed, StackFileError when it cannot
    be updated without touching other content."""
    assert set(values) | set(remove) <= set(MANAGED_KEYS), "not a key the capacity tools own"
    if not path.exists():
        yaml = round_trip_yaml(LAYOUTS[0])
        config = CommentedMap()
        _set_placement(config, values)
        after = _HEADER + dump(yaml, CommentedMap(config=config))
        return StackUpdate(path=path, before=None, after=after)
    read_stack_values(path)  # ConfigError when it is not a stack file
    before = path.read_text()
    if round_trip_yaml(LAYOUTS[0]).load(before) is None:  # empty, or comments only: append the config
        config = CommentedMap()
        _set_placement(config, values)
        sep = "\n" if before and not before.endswith("\n") else ""
        after = before + sep + dump(round_trip_yaml(LAYOUTS[0]), CommentedMap(config=config))
        return StackUpdate(path=path, before=before, after=after)
    yaml, doc = _faithful_yaml(before, path)
    if doc.get("config") is None:
        doc["config"] = CommentedMap()
    _set_placement(doc["config"], values)
    for key in remove:
        doc["config"].pop(key, None)
    after = dump(yaml, doc)
    _check_only_placement_changed(before, after, path, _by_hand(values, remove))
    if _parses(before) is None and (problem := _parses(after)) is not None:
        raise StackFileError(f"{path}: the new placement would not be a valid stack config "
                             f"({problem}); file left untouched")
    return StackUpdate(path=path, before=before, after=after)
