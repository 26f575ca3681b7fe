"""rng.safetensors: every rank's RNG streams (dropout's), in one file that rank 0 writes and in
which each rank reads its own.

Rank 0 gathers the W states (one send from each rank, to rank 0 only) and writes them with the
rest of the files no rank writes by range. At a resume on the same world size each rank reads
the tensors of its own rank: not W states unpickled on each of W ranks, which trainer.pt's list
of them cost before (the checkpoints written so are read by checkpoint/compat.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save

from aiayn.runtime import io_counts
from aiayn.runtime.seeding import rng_of_tensors, rng_tensors

RNG_FILE = "rng.safetensors"
_PARTS = ("python", "python_gauss", "numpy", "numpy_gauss", "torch")


def encode(states: list[dict[str, Any]]) -> bytes:
    """The file's bytes for every rank's `rng_state()`, in rank order."""
    tensors = {
        f"{rank:05d}/{name}": tensor
        for rank, state in enumerate(states)
        for name, tensor in rng_tensors(state).items()
    }
    cuda = all("cuda" in state for state in states)
    return save(tensors, metadata={"world_size": str(len(states)), "cuda": str(int(cuda))})


def read_own(ckpt: Path, rank: int) -> tuple[int, dict[str, Any] | None]:
    """(the world size that saved `ckpt`, rank `rank`'s RNG state, or None when that world
    size had no such rank)."""
    io_counts.opened()
    with safe_open(str(ckpt / RNG_FILE), framework="pt") as fh:
        meta = fh.metadata()
        world = int(meta["world_size"])
        if rank >= world:
            return world, None
        parts = _PARTS + (("cuda",) if meta.get("cuda") == "1" else ())
        return world, rng_of_tensors({p: fh.get_tensor(f"{rank:05d}/{p}") for p in parts})
