"""Resuming on another topology: the optimizer state in a form that no engine owns.

Each engine saves its optimizer state in its own layout: the torch optimizer's (one process
and DDP: one full copy, indexed by parameter position, in trainer.pt and trainer.safetensors)
or files of its own, one per rank, cut differently for every layout and world size (DeepSpeed
ZeRO's flat fp32 partitions, engine/deepspeed_files.py). When a run resumes with the layout it
saved, the engine loads its own format and the resume is bitwise. Otherwise the checkpoint is
read into a `Portable` state, keyed by parameter name and independent of how it was cut, and
the engine loads that (`engine.load_portable`): weights and Adam's moments are resharded, the
step count, the schedule's position and the skipped-step count carry over. The torch layout is
read here; an engine with files of its own reads them (its kind's `portable`). The data
position needs no conversion: it is the group's position in one global stream of batches
(data/loader.py).

Nothing here converts at save time: a checkpoint stays in its writer's format, and the work is
done once, when the topology changes.

Each rank reads only what it keeps. The `Portable` state reads a parameter's tensors by element
range: from model.safetensors and trainer.safetensors through safetensors' slices (`Rows`), and
from rank files mapped into memory, whose partitions are joined virtually (`Pieces`), never
concatenated. A sharded rank asks for its partition of each tensor, so its reads and its host
memory are about 1/W of the state, where reading every old rank's files whole on every new rank
was W_new x the checkpoint. DDP keeps a whole copy of the state and reads the whole of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aiayn.checkpoint import compat
from aiayn.checkpoint.format import MODEL_FILE, TRAINER_TENSORS_FILE, Stored
from aiayn.engine.kind import Topology
from aiayn.engine.registry import saved_topology
from aiayn.engine.state import WEIGHT, Portable, Rows, in_memory, torch_adam_portable


def topology_of(manifest: dict[str, Any], trainer_state: dict[str, Any]) -> Topology:
    """The topology a checkpoint was written on."""
    return saved_topology(manifest["config"], compat.world_size(manifest, trainer_state))


@contextlib.contextmanager
def read(
    ckpt: Path, trainer_state: dict[str, Any], saved: Topology, shapes: dict[str, torch.Size]
) -> Iterator[Portable]:
    """The checkpoint's state as a Portable, its files open while the `with` lasts. `shapes`:
    the trainable parameters, in order. The trainer state's tensors may be left unread
    (format.Stored): they are read by range from trainer.safetensors."""
    if saved.kind.portable is not None:  # files of the engine's own
        with saved.kind.portable(ckpt, trainer_state, shapes) as state:
            yield state
        return
    engine = trainer_state["engine"]
    with contextlib.ExitStack() as files:
        weights = files.enter_context(safe_open(str(ckpt / MODEL_FILE), framework="pt"))
        aliases = weights.metadata() or {}  # tied names: one tensor, stored once
        tensors = {(n, WEIGHT): Rows(weights, aliases.get(n, n)) for n in shapes}
        stored = ckpt / TRAINER_TENSORS_FILE
        trainer = (
            files.enter_context(safe_open(str(stored), framework="pt"))
            if stored.is_file()
            else None
        )
        yield torch_adam_portable(
            engine["optimizer"],
            tensors,
            shapes,
            engine["scheduler"],
            engine.get("skipped_steps", 0),
            lambda t: Rows(trainer, t.key) if isinstance(t, Stored) else in_memory(t),
            lambda step: int(trainer.get_tensor(step.key) if isinstance(step, Stored) else step),
        )
