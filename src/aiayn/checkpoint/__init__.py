"""Checkpoints: the files (format.py), the manager that saves, keeps and restores a run's
(manager.py), and averaging and export for inference (tools.py)."""

from aiayn.checkpoint.format import (  # first: manager.py and distributed/reshard.py use it
    ARCHITECTURE_FIELDS,
    CHECKPOINTS_DIR,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    TRAINER_FILE,
    check_architecture,
    checkpoints_in,
    latest_valid,
    load_checkpoint,
    read_manifest,
    read_trainer_state,
    resolve_checkpoint,
    step_dir_name,
    step_of,
    weights_snapshot,
)
from aiayn.checkpoint.manager import CheckpointManager, Progress

__all__ = [
    "ARCHITECTURE_FIELDS",
    "CHECKPOINTS_DIR",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "TOKENIZER_FILE",
    "TRAINER_FILE",
    "CheckpointManager",
    "Progress",
    "check_architecture",
    "checkpoints_in",
    "latest_valid",
    "load_checkpoint",
    "read_manifest",
    "read_trainer_state",
    "resolve_checkpoint",
    "step_dir_name",
    "step_of",
    "weights_snapshot",
]
