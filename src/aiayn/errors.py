"""Errors a user can act on. The CLI prints their message without a traceback."""


class AiaynError(Exception):
    """Base class: the message names the problem and how to fix it."""

    exit_code = 2  # the CLI's: a person must act; a launcher does not restart (faults.py)


class ConfigError(AiaynError):
    """A config file or override is malformed, unknown, or out of range."""


class DataError(AiaynError):
    """A corpus is missing, empty, mis-aligned, or unreadable."""


class TokenizerError(AiaynError):
    """A tokenizer is missing or does not match the contract a run recorded."""


class CheckpointError(AiaynError):
    """A checkpoint is missing, corrupt, or belongs to another model."""


class RunDirInUse(AiaynError):
    """Another training run holds the run directory (distributed/run_lock.py): two runs in one
    directory would both write its checkpoints. Exit 2: a restart would meet the same holder."""


class TrainingError(AiaynError):
    """Training cannot go on (for example a non-finite loss)."""


class PeerError(TrainingError):
    """A collective failed during training: another rank died or stalled. Not the user's to
    fix: the launcher restarts the group from the latest checkpoint (distributed/run.py)."""

    exit_code = 1


class ExportError(AiaynError):
    """A model cannot be written exactly in the format asked for, or an export is unreadable."""
