"""Typed run configuration: schema, loading, overrides and derived defaults."""

from app.config.load import (
    ConfigError,
    default_gamma,
    default_target_layer_ids,
    load_config,
    target_architecture,
    text_architecture,
    validate_config,
)
from app.config.schema import BUILTIN_TARGETS, RunConfig

__all__ = [
    "BUILTIN_TARGETS",
    "ConfigError",
    "RunConfig",
    "default_gamma",
    "default_target_layer_ids",
    "load_config",
    "target_architecture",
    "text_architecture",
    "validate_config",
]
