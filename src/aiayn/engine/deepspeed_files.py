"""DeepSpeed's checkpoint files, read without DeepSpeed's engine: what another engine (or
another ZeRO stage or world size) resumes from (engine/kind.py's `portable`), and which rank
wrote which file (the ranks verify their own at a resume).

`mp_rank_00_model_states.pt` (ZeRO 0-2; in ZeRO-3 every rank writes its own
`zero_pp_rank_R_mp_rank_00_model_states.pt`) holds `param_shapes` (name -> shape, in the
order parameters are flattened), `lr_scheduler`, `skipped_steps`, and in stage 0 the torch
optimizer's whole state dict (`optimizer`). `zero_pp_rank_R_mp_rank_00_optim_states.pt` holds
rank R's partition of the fp32 weights and of each Adam moment:
  ZeRO 1/2: each param group is one flat vector (every parameter followed by its alignment
    padding), padded at the end and cut into world-size equal contiguous pieces.
  ZeRO 3: every parameter is cut on its own into world-size pieces of ceil(numel / W)
    elements (the last padded); a rank's flat vector is its piece of each, in order.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from aiayn.engine.state import MOMENTS, WEIGHT, Pieces, Portable, torch_adam_portable
from aiayn.errors import CheckpointError

DEEPSPEED_DIR = "deepspeed"  # where every rank's `save_checkpoint` writes (deepspeed_engine.py)


def partition_rank(name: str) -> int | None:
    """The data-parallel rank whose ZeRO partition a file under DEEPSPEED_DIR holds, by
    DeepSpeed's name for it ([bf16_]zero_pp_rank_<r>_...); None for another file."""
    if not name.startswith(DEEPSPEED_DIR + "/"):
        return None
    found = re.search(r"(?:^|_|/)zero_pp_rank_(\d+)_", name)
    return int(found.group(1)) if found else None


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


@contextlib.contextmanager
def read(ckpt: Path, trainer_state: dict[str, Any], shapes: dict) -> Iterator[Portable]:
    """The DeepSpeed shards of `ckpt` as a Portable (engine/kind.py's `portable`)."""
    yield _read(ckpt / DEEPSPEED_DIR, shapes)


def _read(folder: Path, shapes: dict[str, torch.Size]) -> Portable:
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
        return torch_adam_portable(model["optimizer"], weights, shapes, scheduler, skipped)
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
