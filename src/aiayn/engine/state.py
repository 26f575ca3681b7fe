"""The state that engines and checkpoints share, below both: the weights a save writes
(`Weights`), the optimizer state in a form no engine owns (`Portable`), the stretches it is
read from by element range (`Pieces` in memory or mapped, `Rows` of a safetensors file), and
the names both sides use for them.

An engine yields `Weights` to a save and loads a `Portable` on a resume across topologies;
the checkpoint package writes the first and reads the second out of its own files
(checkpoint/reshard.py), or asks the engine's kind to read files of the engine's own
(engine/kind.py). Neither side imports the other: they meet here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from aiayn.errors import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")
WEIGHT = "weight"  # the fp32 (master) weights, beside MOMENTS


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def weights_snapshot(
    module: nn.Module, copy: Callable[[torch.Tensor], torch.Tensor] = host_copy
) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """A host copy of `module`'s weights for safetensors, each tensor once, and its metadata.
    `copy` makes each tensor's (checkpoint/staging.py's, for an async save).

    Tied names (the same tensor under several names) keep the first in sorted order, with the
    others recorded in the metadata, as `safetensors.torch.save_model` does, so `load_model`
    restores the tie. Unlike save_model this also works when a sharded optimizer keeps the
    parameters as views of one flat buffer (ZeRO 1/2): each tensor is copied out of it.
    """
    state = module.state_dict()
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        groups.setdefault((t.data_ptr(), t.dtype, tuple(t.shape)), []).append(name)
    tensors, metadata = {}, {}
    for names in groups.values():
        keep, *tied = sorted(names)
        tensors[keep] = copy(state[keep])
        metadata.update({name: keep for name in tied})
    return tensors, metadata or None


def saved_specs(
    rebuild: Callable[[], nn.Module],
) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """What model.safetensors holds, for an engine whose weights are not whole on a rank: the
    names, dtypes and shapes of a plain model built on the meta device (no memory), each tied
    tensor once under its first name, sorted, the others in the metadata (weights_snapshot's
    rule)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        plain = rebuild()  # building it must not move the dropout RNG
    state = plain.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}  # a tied parameter is one object under several names
    for name, tensor in state.items():
        tied.setdefault(id(tensor), []).append(name)
    specs, metadata = {}, {}
    for names in tied.values():
        keep, *others = sorted(names)
        specs[keep] = state[keep]
        metadata.update({name: keep for name in others})
    return specs, metadata or None


@dataclass
class Weights:
    """The weights a save writes into model.safetensors, each tensor once (tied names in
    `metadata`, as weights_snapshot records them): `specs` gives the names, dtypes and shapes
    (real or meta tensors), and `each(names)` yields the tensors in that order. `transient`:
    a yielded tensor is gone once the next one is asked for (ZeRO-3 gathers them one at a
    time, every rank taking part), so whatever a save keeps of it, it copies."""

    specs: dict[str, torch.Tensor]
    metadata: dict[str, str] | None
    each: Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]]
    transient: bool = False

    @classmethod
    def of(cls, module: nn.Module) -> Weights:
        """A module whose weights are all here (one process, DDP, ZeRO stages 1 and 2)."""
        tensors, metadata = weights_snapshot(module, copy=lambda t: t)
        return cls(tensors, metadata, lambda names: ((n, tensors[n]) for n in names))


class Stretch(Protocol):
    """A flattened tensor read by element range, wherever it is stored (checkpoint/reshard.py's
    `Pieces` of ZeRO rank files, `Rows` of a safetensors file)."""

    numel: int
    itemsize: int

    def read(self, start: int, end: int) -> torch.Tensor: ...


@dataclass
class Portable:
    """The optimizer state by parameter name: each trainable parameter's fp32 weights and
    Adam moments (read by element range of the flattened parameter), Adam's step, the schedule
    and the skipped-step count."""

    shapes: dict[str, torch.Size]  # the trainable parameters
    tensors: dict[tuple[str, str], Stretch]  # (name, WEIGHT or a MOMENT) -> where it is
    step: int  # Adam's step count (bias correction): all parameters step together here
    scheduler: dict[str, Any]  # the LambdaLR state dict: where the schedule is
    skipped_steps: int  # fp16 overflow steps, which the schedule did not count
    bytes_read: int = 0  # what this rank has read of the tensors so far, in their dtypes

    def has_moments(self, name: str) -> bool:
        """False for a parameter Adam never stepped (no gradient yet): it starts from zeros."""
        return (name, MOMENTS[0]) in self.tensors

    def read(self, name: str, key: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor, fp32."""
        source = self.tensors[name, key]
        end = source.numel if end is None else end
        out = source.read(start, end)
        self.bytes_read += out.numel() * source.itemsize
        return out

    def whole(self, name: str, key: str) -> torch.Tensor:
        return self.read(name, key).view(self.shapes[name])

    @property
    def bytes_stored(self) -> int:
        return sum(source.numel * source.itemsize for source in self.tensors.values())


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) in the order every engine hands them to its optimizer; a tied
    parameter once, under its first name (as named_parameters and DeepSpeed name it)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def whole_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """Each trainable parameter's whole shape, by name (`trainable`'s): a ZeRO-3 parameter
    holds an empty tensor in place of its partition and keeps its shape as ds_shape; an
    FSDP2 DTensor's shape is already the whole one."""
    return {name: getattr(p, "ds_shape", p.shape) for name, p in trainable(module)}


class Pieces:
    """Elements held as consecutive 1-D tensor views (a parameter's partitions in several ZeRO
    rank files, mapped from disk): `view` selects a range without reading it, `read` copies one
    range out as fp32."""

    def __init__(self, parts: list[torch.Tensor], numel: int | None = None):
        self.parts = [t for t in parts if t.numel()]
        self.numel = sum(t.numel() for t in self.parts) if numel is None else numel
        self.itemsize = self.parts[0].element_size() if self.parts else 4

    def view(self, start: int, end: int) -> Pieces:
        out, at = [], 0
        for t in self.parts:
            lo, hi = max(start - at, 0), min(end - at, t.numel())
            if lo < hi:
                out.append(t[lo:hi])
            at += t.numel()
        return Pieces(out)

    def read(self, start: int, end: int) -> torch.Tensor:
        parts = self.view(start, end).parts
        return torch.cat([t.float() for t in parts]) if parts else torch.zeros(0)


class Rows:
    """A tensor of a safetensors file, read by element range: only the rows that hold it."""

    def __init__(self, handle, key: str):
        self.handle, self.key = handle, key
        stored = handle.get_slice(key)
        self.shape = list(stored.get_shape())
        self.numel = math.prod(self.shape)
        self.itemsize = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}.get(stored.get_dtype(), 4)

    def read(self, start: int, end: int) -> torch.Tensor:
        if len(self.shape) < 2:
            return self.handle.get_slice(self.key)[start:end].reshape(-1).float()
        row = self.numel // self.shape[0]
        first = start // row
        rows = self.handle.get_slice(self.key)[first : -(-end // row)].reshape(-1)
        return rows[start - first * row : end - first * row].float()


def in_memory(value: torch.Tensor) -> Pieces:
    return Pieces([value.flatten()])


def torch_adam_portable(
    state: dict[str, Any],
    tensors: dict[tuple[str, str], Stretch],
    shapes: dict[str, torch.Size],
    scheduler: dict,
    skipped: int,
    stretch: Callable[[Any], Stretch] = in_memory,
    number: Callable[[Any], int] = int,
) -> Portable:
    """A torch Adam state dict (one param group, indexed by position) with the weights'
    `tensors`, as a Portable. Its tensors are in memory, or left unread where `stretch` (each
    moment's) and `number` (a step count's) find them (checkpoint/reshard.py's trainer file)."""
    (group,) = state["param_groups"]
    if len(group["params"]) != len(shapes):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(group['params'])} parameters, this model "
            f"{len(shapes)}: it was written by another model; use a new run_dir"
        )
    steps = set()
    tensors = dict(tensors)
    for index, name in zip(group["params"], shapes, strict=True):
        entry = state["state"].get(index)
        if entry is None:  # never stepped (no gradient yet): Adam starts it from zeros
            continue
        tensors.update({(name, k): stretch(entry[k]) for k in MOMENTS})
        steps.add(number(entry["step"]))
    if len(steps) > 1:
        raise CheckpointError(
            f"parameters have different Adam step counts {sorted(steps)}: a sharded optimizer "
            "keeps one; resume this checkpoint with the backend it was written by"
        )
    return Portable(dict(shapes), tensors, steps.pop() if steps else 0, scheduler, skipped)
