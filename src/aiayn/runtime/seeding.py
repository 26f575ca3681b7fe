"""Seeds and RNG states: what dropout and initialisation draw from, saved with every checkpoint."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger("aiayn")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # all CUDA devices too


def rng_state() -> dict[str, Any]:
    """Plain types and tensors only: checkpoints load with torch.load(weights_only=True)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        # This rank's generator only: under torchrun each rank sees every GPU of its node but
        # draws from one, and a resume may see another number of them (srun --gpus-per-task).
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def load_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        _load_cuda_rng_state(state["cuda"])


def _load_cuda_rng_state(saved: torch.Tensor | list[torch.Tensor]) -> None:
    """Restore this rank's CUDA generator. Checkpoints written before it saved one generator
    hold a list, one state per GPU the rank saw, in device order: this rank drew from the
    entry of its own device index."""
    device = torch.cuda.current_device()
    if isinstance(saved, torch.Tensor):
        torch.cuda.set_rng_state(saved, device)
    elif device < len(saved):
        torch.cuda.set_rng_state(saved[device], device)
    else:
        log.warning(
            "the checkpoint holds CUDA RNG states for %d devices, none for cuda:%d: its "
            "generator keeps the run's seed, so dropout masks differ from the saved run's",
            len(saved),
            device,
        )
