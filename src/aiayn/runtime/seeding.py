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


def rng_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`rng_state()` as tensors, for a safetensors file in which each rank reads its own
    (checkpoint/rng_file.py): Python's and NumPy's generators as int64 words and a float64
    (the cached Gaussian; NaN for none), torch's as its bytes."""
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    if kind != "MT19937":
        raise ValueError(f"NumPy's global generator is {kind}, not MT19937")
    out = {
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor(
            [float("nan") if gauss is None else gauss], dtype=torch.float64
        ),
        "numpy": torch.tensor([*keys, pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": state["torch"],
    }
    if "cuda" in state:
        out["cuda"] = state["cuda"]
    return out


def rng_of_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The `rng_state()` that `rng_tensors` stored."""
    python, numpy = tensors["python"].tolist(), tensors["numpy"].tolist()
    gauss = tensors["python_gauss"].item()
    state = {
        "python": (python[0], tuple(python[1:]), None if gauss != gauss else gauss),
        "numpy": ["MT19937", numpy[:-2], numpy[-2], numpy[-1], tensors["numpy_gauss"].item()],
        "torch": tensors["torch"],
    }
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"]
    return state
