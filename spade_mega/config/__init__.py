"""Configuration: typed dataclass schema, YAML with ``base:`` inheritance, dotted overrides, clear errors."""

from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import (
    apply_overrides,
    build,
    load_config,
    load_raw,
    prepare_run_dir,
    save_resolved,
    to_dict,
    to_yaml,
)
from spade_mega.config.schema import (
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardsConfig,
    RLConfig,
    RolloutConfig,
    RunConfig,
    SelfPlayConfig,
    SpadeConfig,
)

__all__ = [
    "ConfigError", "apply_overrides", "build", "load_config", "load_raw", "prepare_run_dir", "save_resolved",
    "to_dict", "to_yaml", "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "RolloutConfig",
    "RunConfig", "SelfPlayConfig", "SpadeConfig", "RewardsConfig", "RLConfig",
]
