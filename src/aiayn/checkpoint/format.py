"""What a checkpoint is on disk: its layout, manifest and checks, and loading one.

Layout of a run directory:

    run_dir/checkpoints/step_00001000/
        model.safetensors   weights (tied matrices stored once); loads without unpickling code
        ema.safetensors     train.ema's moving average of them, the same names (RUN/ema)
        trainer.pt          optimizer, schedule, data position, counters; its
                            tensors (Adam's moments) stand as {"__tensor__": key} ...
        trainer.safetensors ... for the tensors held here under those keys
        rng.safetensors     every rank's RNG streams, each rank reading its own (rng_file.py)
        manifest.json       step, sizes and sha256 of the files above, config, tokenizer contract

Every rank writes a byte range of model.safetensors and trainer.safetensors, hashed as it
writes (runtime/tensor_files.py); the manifest records each range's sha256. Checkpoints
written before hold the tensors in trainer.pt and one sha256 per file: they load the same.
    run_dir/checkpoints/latest   name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, flushed and fsynced, then renamed
into place; only then does `latest` move (checkpoint/writer.py). A crash at any moment leaves
the previous checkpoint loadable, and a directory without a valid manifest is never loaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model
from torch import nn

from aiayn.errors import CheckpointError
from aiayn.runtime import io_counts
from aiayn.runtime.durable import checksums_match, sha256_of
from aiayn.runtime.tensor_files import DTYPES
from aiayn.tokenizer import check_contract

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"  # under run_dir
MODEL_FILE, TRAINER_FILE, MANIFEST_FILE = "model.safetensors", "trainer.pt", "manifest.json"
TRAINER_TENSORS_FILE = "trainer.safetensors"
# train.ema's moving average of the weights: model.safetensors' names, ties and layout, fp32.
EMA_FILE = "ema.safetensors"
# The name that picks it as a model: RUN/ema, RUN/best/ema, CKPT/ema (checkpoint/locate.py).
EMA = "ema"
# Pointer files in checkpoints/, each naming a step directory (checkpoint/retention.py).
BEST, LATEST = "best", "latest"
_TENSOR_KEY = "__tensor__"
# A copy of the SentencePiece model, in checkpoints made by averaging (self-contained).
TOKENIZER_FILE = "tokenizer.model"
# Fields that decide tensor shapes or meaning: a checkpoint differing in any cannot be loaded.
ARCHITECTURE_FIELDS = (
    "kind",
    "N",
    "decoder_layers",
    "d_model",
    "d_ff",
    "h",
    "positions",
    "norm",
    "share_embeddings",
    "num_classes",
    "pooling",
    "activation",
    "attention_bias",
    "output_bias",
)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def split_tensors(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """`state` with each tensor safetensors can hold replaced by {"__tensor__": key}, and
    those tensors by key: the tensors go into a file every rank writes a range of."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dtype in DTYPES:
            tensors[key] = obj
            return {_TENSOR_KEY: key}
        if isinstance(obj, dict):
            return {k: walk(v, f"{key}/{k}") for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(walk(v, f"{key}/{i}") for i, v in enumerate(obj))
        return obj

    return walk(state, ""), tensors


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state split_tensors split."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR_KEY}:
            return tensors[skeleton[_TENSOR_KEY]]
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(join_tensors(v, tensors) for v in skeleton)
    return skeleton


def read_manifest(
    ckpt: Path, verify: bool = True, files: Callable[[str], bool] | None = None
) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError if it is incomplete or corrupt.
    `files` picks the files checked (all by default): none, where resume_point has verified
    this rank's share, since every rank checking every file would be W stats on each of W
    ranks under ZeRO (two files per rank)."""
    try:
        manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{ckpt} has no readable {MANIFEST_FILE} ({exc})") from None
    for name, meta in manifest.get("files", {}).items():
        if files is not None and not files(name):
            continue
        path = ckpt / name
        try:
            found = io_counts.stat(path)  # one metadata call: size and kind together
        except OSError:
            found = None
        if found is None or not stat.S_ISREG(found.st_mode) or found.st_size != meta["bytes"]:
            raise CheckpointError(f"{path} is missing or truncated")
        if verify and not checksums_match(path, meta):
            raise CheckpointError(f"{path} does not match its checksum: the file is corrupt")
    return manifest


def check_architecture(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Raise if the checkpoint was written by a model of another shape. A field a checkpoint
    does not record is older than it: the model then had its default."""
    from aiayn.config import ModelConfig

    saved = {**dataclasses.asdict(ModelConfig()), **saved}
    diffs = [
        f"model.{k}: checkpoint {saved.get(k)!r}, config {current.get(k)!r}"
        for k in ARCHITECTURE_FIELDS
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise CheckpointError(
            f"{where} was written by a different model:\n  "
            + "\n  ".join(diffs)
            + "\nUse the config the checkpoint was trained with, or a new run_dir."
        )


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.rsplit("_", 1)[1])


def checkpoints_in(root: Path) -> list[Path]:
    """Complete-looking checkpoint directories under `root` (run_dir/checkpoints), oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.name[5:].isdigit() and p.is_dir())


def latest_valid(root: Path) -> Path | None:
    """The newest checkpoint under `root` that validates; broken ones are skipped with a warning."""
    for ckpt in reversed(checkpoints_in(root)):
        try:
            read_manifest(ckpt)
            return ckpt
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", ckpt.name, exc)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the latest valid one of a run directory, or the one a
    pointer names (RUN/best or RUN/latest, or the files in RUN/checkpoints); verified."""
    path = Path(path)
    if path.name in (BEST, LATEST) and not path.is_dir():
        return _follow(path)
    if (path / MANIFEST_FILE).is_file():
        read_manifest(path)  # a corrupt checkpoint named explicitly is an error, not a fallback
        return path
    for root in (path / CHECKPOINTS_DIR, path):  # a run_dir, or its checkpoints/ folder
        found = latest_valid(root)
        if found is not None:
            return found
    raise CheckpointError(
        f"no valid checkpoint at {path}: pass a run_dir holding checkpoints/ or a "
        "checkpoints/step_XXXXXXXX directory"
    )


def ema_of(path: str | Path) -> Path | None:
    """The checkpoint (or run, or pointer) whose train.ema weights `path` names (RUN/ema,
    RUN/best/ema, CKPT/ema), or None where `path` names something else: an existing
    directory or file called ema is itself, as before."""
    path = Path(path)
    return path.parent if path.name == EMA and not path.exists() else None


def ema_weights(ckpt: Path, manifest: dict[str, Any]) -> Path:
    """The checkpoint's ema.safetensors, which CKPT/ema names; CheckpointError without one."""
    if EMA_FILE not in manifest["files"]:
        raise CheckpointError(
            f"{ckpt}/{EMA} names the moving average of the checkpoint's weights, and it holds "
            "none: it was saved without train.ema (or averages checkpoints without one). Name "
            "the checkpoint itself, or train with train.ema set"
        )
    return ckpt / EMA_FILE


def _follow(path: Path) -> Path:
    """The checkpoint a pointer names: RUN/checkpoints/NAME, given as that or as RUN/NAME."""
    for pointer in (path, path.parent / CHECKPOINTS_DIR / path.name):
        if pointer.is_file():
            ckpt = pointer.parent / pointer.read_text().strip()
            read_manifest(ckpt)
            return ckpt
    if path.name == BEST:
        raise CheckpointError(
            f"{path.parent} has no best checkpoint yet: none has recorded "
            "checkpoint.best_metric (a checkpoint saved at a validation step records it)"
        )
    raise CheckpointError(f"{path.parent} has no checkpoints/{LATEST}: it has saved none yet")


def tokenizer_file(ckpt: Path, manifest: dict[str, Any]) -> Path | None:
    """The SentencePiece model a checkpoint was trained with: the copy an averaged checkpoint
    carries, or the file its config names, where its sha256 is the one recorded."""
    from aiayn.config import config_from_dict

    candidates = [ckpt / TOKENIZER_FILE]
    try:
        candidates.append(config_from_dict(manifest["config"]).tokenizer_path)
    except Exception:  # noqa: BLE001 (a config this version cannot read names no file)
        pass
    want = manifest["tokenizer"].get("sha256")
    return next((p for p in candidates if p.is_file() and sha256_of(p) == want), None)


def load_checkpoint(
    ckpt: Path,
    model: nn.Module | None,
    *,
    expect_model: Any = None,
    tokenizer: Any = None,
    verify: bool = True,
    with_trainer_state: bool = True,
    lazy: Callable[[str], bool] | None = None,
    files: Callable[[str], bool] | None = None,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Load weights into `model`; return (trainer_state, manifest). Never unpickles code.

    `model=None` loads no weights: a sharded engine restores them from its own shards.

    `expect_model` (a ModelConfig) and `tokenizer` are checked against what the checkpoint
    recorded before any tensor is read, so a mismatch names its fields instead of a shape.
    `verify=False` skips the checksums for a checkpoint that `CheckpointManager.latest` or
    `resolve_checkpoint` has just verified: hashing the weights twice doubles the load time.
    `with_trainer_state=False` (inference) reads no optimizer state and returns None for it;
    averaged checkpoints have none. `lazy`: which of the trainer state's tensors to leave
    unread (read_trainer_state). `files`: the files whose sizes are checked (read_manifest).
    """
    manifest = read_manifest(ckpt, verify=verify, files=files)
    if expect_model is not None:
        check_architecture(manifest["config"]["model"], dataclasses.asdict(expect_model), str(ckpt))
    if tokenizer is not None:
        check_contract(manifest["tokenizer"], tokenizer, where=str(ckpt))
    missing, unexpected = [], []
    try:
        if model is not None:
            io_counts.opened()  # safetensors opens files in Rust: no audit event
            missing, unexpected = load_model(model, str(ckpt / MODEL_FILE), strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise CheckpointError(f"{ckpt} does not fit this model: {exc}") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt} does not fit this model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    if not with_trainer_state:
        return None, manifest
    if TRAINER_FILE not in manifest["files"]:
        raise CheckpointError(
            f"{ckpt} holds weights only (an averaged checkpoint?): it can be translated and "
            "evaluated, not resumed. Resume from a checkpoint the run saved."
        )
    return read_trainer_state(ckpt, lazy), manifest


@dataclass(frozen=True)
class Stored:
    """A tensor of trainer.safetensors left unread (read_trainer_state's `lazy`): resharding
    reads only the ranges of it that this rank keeps (checkpoint/reshard.py)."""

    key: str


def read_trainer_state(ckpt: Path, lazy: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """trainer.pt, with its tensors put back from trainer.safetensors where they are there
    (checkpoints written before hold them in trainer.pt); those whose key `lazy` accepts
    ("/engine/optimizer/state/3/exp_avg") stand as `Stored` placeholders, unread."""
    trainer_state = torch.load(ckpt / TRAINER_FILE, map_location="cpu", weights_only=True)
    path = ckpt / TRAINER_TENSORS_FILE
    if not io_counts.exists(path):
        return trainer_state
    io_counts.opened()
    if lazy is None:
        return join_tensors(trainer_state, load_file(path))
    with safe_open(str(path), framework="pt") as fh:
        tensors = {k: Stored(k) if lazy(k) else fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    return join_tensors(trainer_state, tensors)


def read_stored(state: Any, ckpt: Path) -> Any:
    """`state` with every `Stored` placeholder read from the checkpoint's trainer.safetensors."""
    keys: list[str] = []
    _tree_map(state, lambda leaf: isinstance(leaf, Stored) and keys.append(leaf.key))
    if not keys:
        return state
    io_counts.opened()
    with safe_open(str(ckpt / TRAINER_TENSORS_FILE), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in keys}
    return _tree_map(state, lambda leaf: tensors[leaf.key] if isinstance(leaf, Stored) else leaf)


def _tree_map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, dict):
        return {k: _tree_map(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_tree_map(v, fn) for v in obj)
    return fn(obj)
