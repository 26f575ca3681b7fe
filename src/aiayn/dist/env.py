"""The process environment: rank, world size, device. One owner for all of it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from aiayn.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """auto: CUDA when present (one device per local rank), else CPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def setup(device_choice: str) -> DistEnv:
    """Read the launcher's environment (torchrun, accelerate and srun all set these variables)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1:
        raise ConfigError(
            f"WORLD_SIZE={world_size}: this build trains on one process; multi-process "
            "training (DDP, DeepSpeed) is not available yet. Run without torchrun."
        )
    return DistEnv(rank, world_size, local_rank, pick_device(device_choice, local_rank))
