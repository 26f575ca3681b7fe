"""Resuming on another topology: the optimizer state in a form that no engine owns.

Each engine saves its optimizer state in its own layout: the torch optimizer's (Local and
DDP: one full copy, indexed by parameter position, in trainer.pt) or DeepSpeed ZeRO's (flat
fp32 partitions, one file per rank, cut differently for every stage and world size). When a
run resumes with the layout it saved, the engine loads its own format and the resume is
bitwise. Otherwise the checkpoint is read into a `Portable` state, keyed by parameter name and
independent of how it was cut, and the engine loads that (`engine.load_portable`): weights and
Adam's moments are resharded, the step count, the schedule's position and the skipped-step
count carry over. The data position needs no conversion: it is the group's position in one
global stream of batches (data/loader.py).

Nothing here converts at save time: a checkpoint stays in its writer's format, and the work is
done once, when the topology changes.

Each rank reads only what it keeps. The `Portable` state reads a parameter's tensors by element
range: from model.safetensors and trainer.safetensors through safetensors' slices, and from
DeepSpeed's rank files mapped into memory (torch.load's mmap), whose partitions are joined
virtually (`Pieces`), never concatenated. A ZeRO rank asks for its partition of each tensor,
so its reads and its host memory are about 1/W of the state, where reading every old rank's
files whole on every new rank was W_new x the checkpoint. DDP keeps a whole copy of the state
and reads the whole of it.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aiayn.checkpoint import compat
from aiayn.checkpoint.format import MODEL_FILE, TRAINER_TENSORS_FILE, Stored
from aiayn.engine.state import DEEPSPEED_DIR, MOMENTS, WEIGHT, Portable
from aiayn.errors import CheckpointError


@dataclass(frozen=True)
class Topology:
    """What decides the optimizer state's layout on disk."""

    backend: str  # "ddp" (one process or DDP: the same torch layout) or "deepspeed"
    zero_stage: int
    world_size: int

    def __str__(self) -> str:
        if self.backend == "deepspeed":
            return f"DeepSpeed ZeRO-{self.zero_stage} on {self.world_size} rank(s)"
        return f"DDP on {self.world_size} rank(s)"

    def same_layout(self, other: Topology) -> bool:
        """True if an engine of `other` loads this topology's files in its own format."""
        if self.backend != other.backend:
            return False
        # A torch optimizer's state is the same whole copy on any number of ranks.
        return self.backend == "ddp" or self == other

    @classmethod
    def of(cls, cfg: Any, world_size: int) -> Topology:
        par = cfg.distributed
        stage = par.zero_stage if par.backend == "deepspeed" else 0
        return cls(par.backend, stage, world_size)

    @classmethod
    def of_checkpoint(cls, manifest: dict[str, Any], trainer_state: dict[str, Any]) -> Topology:
        par = manifest["config"].get("distributed", {})
        backend = par.get("backend", "ddp")
        stage = par.get("zero_stage", 0) if backend == "deepspeed" else 0
        return cls(backend, stage, compat.world_size(manifest, trainer_state))


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


@contextlib.contextmanager
def read(
    ckpt: Path, trainer_state: dict[str, Any], saved: Topology, shapes: dict[str, torch.Size]
) -> Iterator[Portable]:
    """The checkpoint's state as a Portable, its files open while the `with` lasts. `shapes`:
    the trainable parameters, in order. The trainer state's tensors may be left unread
    (format.Stored): they are read by range from trainer.safetensors."""
    if saved.backend == "deepspeed":
        yield _read_deepspeed(ckpt / DEEPSPEED_DIR, shapes)
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
        yield _from_torch_optimizer(
            engine["optimizer"],
            tensors,
            shapes,
            engine["scheduler"],
            engine.get("skipped_steps", 0),
            trainer,
        )


def _from_torch_optimizer(
    state: dict[str, Any],
    tensors: dict[tuple[str, str], Pieces | Rows],
    shapes: dict[str, torch.Size],
    scheduler: dict,
    skipped: int,
    trainer=None,
) -> Portable:
    """A torch Adam state dict: `state` is indexed by position in the (single) param group.
    Its tensors are in memory, or `Stored` in `trainer` (trainer.safetensors, open)."""
    (group,) = state["param_groups"]
    if len(group["params"]) != len(shapes):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(group['params'])} parameters, this model "
            f"{len(shapes)}: it was written by another model; use a new run_dir"
        )

    def source(value) -> Pieces | Rows:
        return Rows(trainer, value.key) if isinstance(value, Stored) else Pieces([value.flatten()])

    steps = set()
    tensors = dict(tensors)
    for index, name in zip(group["params"], shapes, strict=True):
        entry = state["state"].get(index)
        if entry is None:  # never stepped (no gradient yet): Adam starts it from zeros
            continue
        tensors.update({(name, k): source(entry[k]) for k in MOMENTS})
        step = entry["step"]
        steps.add(int(trainer.get_tensor(step.key) if isinstance(step, Stored) else step))
    if len(steps) > 1:
        raise CheckpointError(
            f"parameters have different Adam step counts {sorted(steps)}: a sharded optimizer "
            "keeps one; resume this checkpoint with the backend it was written by"
        )
    return Portable(dict(shapes), tensors, steps.pop() if steps else 0, scheduler, skipped)


# ---- DeepSpeed's files --------------------------------------------------------------------
#
# `mp_rank_00_model_states.pt` (ZeRO 0-2; in ZeRO-3 every rank writes its own
# `zero_pp_rank_R_mp_rank_00_model_states.pt`) holds `param_shapes` (name -> shape, in the
# order parameters are flattened), `lr_scheduler`, `skipped_steps`, and in stage 0 the torch
# optimizer's whole state dict (`optimizer`). `zero_pp_rank_R_mp_rank_00_optim_states.pt` holds
# rank R's partition of the fp32 weights and of each Adam moment:
#   ZeRO 1/2: each param group is one flat vector (every parameter followed by its alignment
#     padding), padded at the end and cut into world-size equal contiguous pieces.
#   ZeRO 3: every parameter is cut on its own into world-size pieces of ceil(numel / W)
#     elements (the last padded); a rank's flat vector is its piece of each, in order.


def _load_pickle(path: Path) -> dict[str, Any]:
    """A DeepSpeed file, mapped into memory: a tensor's bytes are read when a range of it is
    (Pieces.read). It pickles a few DeepSpeed classes, so we allow exactly those and nothing
    else (weights_only): the manifest's checksums were verified before, too."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing
        raise CheckpointError(
            f"cannot read DeepSpeed shard {path} ({str(exc).splitlines()[0]}): it was written "
            "by another DeepSpeed version or holds other objects; resume it on the topology "
            "it was written by (same backend, ZeRO stage and world size)"
        ) from None


def _rank_files(folder: Path, suffix: str) -> list[Path]:
    found = {}
    for path in folder.glob(f"*{suffix}"):
        match = re.fullmatch(rf"zero_pp_rank_(\d+)_mp_rank_00_{suffix}", path.name)
        if match:
            found[int(match[1])] = path
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{folder}: {suffix} files of ranks {sorted(found)}: some missing")
    return [found[r] for r in range(len(found))]


def _read_deepspeed(folder: Path, shapes: dict[str, torch.Size]) -> Portable:
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is missing: the checkpoint has no DeepSpeed shards")
    model_file = folder / "mp_rank_00_model_states.pt"
    if not model_file.is_file():  # ZeRO-3: every rank wrote one; they agree on what we read
        model_file = _rank_files(folder, "model_states.pt")[0]
    model = _load_pickle(model_file)
    scheduler, skipped = model["lr_scheduler"], int(model.get("skipped_steps", 0))
    if model.get("optimizer") is not None:  # stage 0: DeepSpeed kept the torch optimizer
        missing = [n for n in shapes if n not in model["module"]]
        if missing:
            raise _other_model(folder, missing)
        weights = {(n, WEIGHT): Pieces([model["module"][n].flatten()]) for n in shapes}
        return _from_torch_optimizer(model["optimizer"], weights, shapes, scheduler, skipped)
    saved = {n: torch.Size(s) for group in model["param_shapes"] for n, s in group.items()}
    if list(saved) != list(shapes):
        raise _other_model(folder, sorted(set(shapes) ^ set(saved)) or list(shapes))
    ranks = [
        _load_pickle(p)["optimizer_state_dict"] for p in _rank_files(folder, "optim_states.pt")
    ]
    if int(ranks[0]["zero_stage"]) == 3:
        flats, step = _zero3_flats(ranks)
        each = {key: _zero3_pieces(flat, saved, len(ranks)) for key, flat in flats.items()}
    else:
        flats, step = _zero12_flats(ranks)
        paddings = ranks[0].get("param_alignment_paddings")
        groups = model["param_shapes"]
        each = {key: _zero12_pieces(flat, groups, paddings) for key, flat in flats.items()}
    tensors = {(n, key): each[key][n] for key in each for n in shapes}
    return Portable(dict(shapes), tensors, step, scheduler, skipped)


def _other_model(folder: Path, names: list[str]) -> CheckpointError:
    return CheckpointError(
        f"{folder} does not hold this model's parameters (differing: {names[:3]}): it was "
        "written by another model; use the config it was trained with, or a new run_dir"
    )


def _step_of(states: list[dict]) -> int:
    steps = {int(s["step"]) for s in states}
    if len(steps) != 1:
        raise CheckpointError(f"the ZeRO partitions disagree on Adam's step count: {steps}")
    return steps.pop()


def _zero12_flats(ranks: list[dict]) -> tuple[dict[str, list[Pieces]], int]:
    """Per param group, its whole flat vector of the fp32 weights and of each moment: the
    ranks' partitions in order."""
    groups = range(len(ranks[0]["single_partition_of_fp32_groups"]))
    states = [r["base_optimizer_state"]["state"][g] for r in ranks for g in groups]
    flats = {
        WEIGHT: [Pieces([r["single_partition_of_fp32_groups"][g] for r in ranks]) for g in groups]
    }
    for key in MOMENTS:
        flats[key] = [
            Pieces([r["base_optimizer_state"]["state"][g][key] for r in ranks]) for g in groups
        ]
    return flats, _step_of(states)


def _zero12_pieces(flat_groups: list[Pieces], groups: list[dict], paddings) -> dict[str, Pieces]:
    """Each group's flat vector cut into its parameters (`groups`: name -> shape per group)."""
    out = {}
    for g, (flat, shapes) in enumerate(zip(flat_groups, groups, strict=True)):
        shapes = {n: torch.Size(s) for n, s in shapes.items()}
        pads = paddings[g] if paddings else [0] * len(shapes)
        _check_size(flat.numel, sum(s.numel() for s in shapes.values()) + sum(pads), exact=False)
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads, strict=True):
            out[name] = flat.view(offset, offset + shape.numel())
            offset += shape.numel() + pad
    return out


def _check_size(have: int, need: int, exact: bool) -> None:
    if need > have or (exact and need != have):
        raise CheckpointError(
            f"the ZeRO partitions hold {have} elements where the parameters need {need}: "
            "the shards do not belong to this model; use its config or a new run_dir"
        )


def _zero3_flats(ranks: list[dict]) -> tuple[dict[str, list[Pieces]], int]:
    """Per rank, its flat vector (sub-groups in order) of the fp32 weights and of each moment."""
    inner = [r["optimizer_state_dict"]["state"] for r in ranks]
    flats = {WEIGHT: [Pieces(list(r["fp32_flat_groups"])) for r in ranks]}
    for key in MOMENTS:
        flats[key] = [Pieces([s[g][key] for g in sorted(s)]) for s in inner]
    return flats, _step_of([s[g] for s in inner for g in s])


def _zero3_pieces(
    rank_flats: list[Pieces], shapes: dict[str, torch.Size], world: int
) -> dict[str, Pieces]:
    """Each parameter: its piece of ceil(numel / world) elements in every rank's flat vector,
    in rank order (the last piece's padding beyond numel is never read)."""
    pieces = {name: math.ceil(shape.numel() / world) for name, shape in shapes.items()}
    _check_size(rank_flats[0].numel, sum(pieces.values()), exact=True)
    out, offset = {}, 0
    for name, shape in shapes.items():
        piece = pieces[name]
        parts = [t for flat in rank_flats for t in flat.view(offset, offset + piece).parts]
        out[name] = Pieces(parts, numel=shape.numel())
        offset += piece
    return out
