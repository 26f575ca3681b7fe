"""Typed run configuration: the only reader of YAML and command-line overrides.

schema.py declares every section and key (the module to read to learn them), checks.py the
range and cross-key checking they use, loading.py reading a file and overrides into a Config.
"""

from aiayn.config.loading import apply_override, config_from_dict, keys_set, load_config
from aiayn.config.schema import (
    MODEL_PRESETS,
    CheckpointConfig,
    Config,
    DataConfig,
    DecodeConfig,
    DistributedConfig,
    InitConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    SourceConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "MODEL_PRESETS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DecodeConfig",
    "DistributedConfig",
    "InitConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ScheduleConfig",
    "SourceConfig",
    "TokenizerConfig",
    "TrainConfig",
    "apply_override",
    "config_from_dict",
    "keys_set",
    "load_config",
]
