"""Checkpoints: the files (format.py), the manager that saves, keeps and restores a run's
(manager.py; it writes them with writer.py and resumes with resume.py; every rank's RNG
streams in rng_file.py), resuming on another
topology (reshard.py), averaging and export for inference (average.py), loading a model to
infer (inference.py) or to start from (init_from.py), found by locate.py. Above engine/: an
engine hands its state over in engine/state.py's types and never imports this package."""

from aiayn.checkpoint.format import (
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
]
