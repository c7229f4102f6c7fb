"""The stack configuration: one typed, validated model of `Pulumi.<stack>.yaml`.

Written by `python -m capacity probe`, read by the Pulumi program and by `python -m infra render`.
This module imports no Pulumi so the probe and the tests can use it without a Pulumi engine.
Every bad value is refused naming the key, the value and the fix, before any resource is declared
or any cloud call is made; all of a config's problems are reported at once (`ConfigErrors`), and
read from a stack file, each with its line.

The package, by concern: `schema` (StackConfig, its keys, the reservation it targets), `errors`,
`rules` (every setting but the reservation), `reservation_rules`, `parsing` (a `config:` mapping
into a StackConfig) and `stack_file` (files read with each problem's line). Import from here.
"""

from infra.config.errors import NO_VALUE, ConfigError, ConfigErrors
from infra.config.parsing import check_settings, coerce_values, parse_stack_config
from infra.config.rules import SUPPORTED_KUBERNETES_MINORS, az_id_prefix
from infra.config.schema import (CAPACITY_TYPES, DEFAULT_RAY_IMAGE, KNOWN_KEYS, MLFLOW_SIZES, PLACEMENT_FIELDS,
                                 PROJECT, REGION_KEY, RESERVATION_FIELDS, RESERVATION_KINDS, SPOT_FIELDS,
                                 GpuReservation, StackConfig,
                                 config_key, format_utc, parse_utc)
from infra.config.stack_file import (check_stack_file_settings, key_lines, load_stack_config, located,
                                     read_stack_values, require_stack_file, stack_file)

__all__ = [
    "NO_VALUE", "ConfigError", "ConfigErrors", "check_settings", "coerce_values", "parse_stack_config",
    "SUPPORTED_KUBERNETES_MINORS", "az_id_prefix", "CAPACITY_TYPES", "SPOT_FIELDS",
    "DEFAULT_RAY_IMAGE", "KNOWN_KEYS", "MLFLOW_SIZES", "PLACEMENT_FIELDS",
    "PROJECT", "REGION_KEY", "RESERVATION_FIELDS", "RESERVATION_KINDS", "GpuReservation", "StackConfig",
    "config_key", "format_utc", "parse_utc", "check_stack_file_settings", "key_lines", "load_stack_config",
    "located", "read_stack_values", "require_stack_file", "stack_file",
]
