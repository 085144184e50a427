"""Typed run configuration: schema, loading, overrides and derived defaults."""

from app.config.builtins import BUILTIN_TARGETS
from app.config.load import (
    ConfigError,
    default_gamma,
    default_target_layer_ids,
    load_config,
    require_builtin_packages,
    target_architecture,
    text_architecture,
    validate_config,
)
from app.config.schema import RunConfig

__all__ = [
    "BUILTIN_TARGETS",
    "ConfigError",
    "RunConfig",
    "default_gamma",
    "default_target_layer_ids",
    "load_config",
    "require_builtin_packages",
    "target_architecture",
    "text_architecture",
    "validate_config",
]
