"""Reads the running stack's whole configuration into the typed StackConfig, before any resource
is declared: a bad value stops `pulumi preview` with the key, the value and the fix."""

from __future__ import annotations

from typing import Any

import pulumi
from pulumi.runtime import config as runtime_config

from infra.config import ConfigError, StackConfig, parse_stack_config


def running_stack_values() -> dict[str, Any]:
    """Every config key of the running stack, from wherever the engine put it."""
    # Pulumi exposes single keys publicly but not the list of keys, which is what catches a
    # misspelled key; the engine hands them over in PULUMI_CONFIG or the config map. Older
    # engines spelled keys `namespace:config:name`.
    merged = {**runtime_config.get_config_env(), **runtime_config.CONFIG.get()}
    return {key.replace(":config:", ":", 1): value for key, value in merged.items()}


def load_running_stack_config() -> StackConfig:
    """The validated config of the running stack; pulumi.RunError (one line, no traceback) if
    any value is wrong."""
    try:
        return parse_stack_config(running_stack_values())
    except ConfigError as exc:
        raise pulumi.RunError(f"stack {pulumi.get_stack()}: {exc}") from None
