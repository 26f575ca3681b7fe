"""Typed run configuration: the only reader of YAML and command-line overrides.

Each section is a dataclass declared, with its keys' types, defaults, documentation and ranges,
in the module of its group: model.py (model, tokenizer, MODEL_PRESETS), data.py (data and its
sources), training.py (optim, schedule, train), run.py (distributed, init, checkpoint, logging),
decode.py (decode). schema.py's Config is the whole run configuration: the sections in order
and the checks across them. checks.py holds the range checking and the Section base they all
use, loading.py reading a file and overrides into a Config.
"""

from aiayn.config.data import DataConfig, SourceConfig
from aiayn.config.decode import DecodeConfig
from aiayn.config.loading import apply_override, config_from_dict, keys_set, load_config
from aiayn.config.model import MODEL_PRESETS, ModelConfig, TokenizerConfig
from aiayn.config.run import CheckpointConfig, DistributedConfig, InitConfig, LoggingConfig
from aiayn.config.schema import Config
from aiayn.config.training import OptimConfig, ScheduleConfig, TrainConfig

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
