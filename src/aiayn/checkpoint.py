"""The checkpoint manager: layout, atomic writes, manifest, retention, resume.

Layout of a run directory:

    run_dir/checkpoints/step_00001000/
        model.safetensors   weights (tied matrices stored once); loads without unpickling code
        trainer.pt          optimizer, schedule, data position, RNG states, counters
        manifest.json       step, sizes and sha256 of the files above, config, tokenizer contract
    run_dir/checkpoints/latest   name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, flushed and fsynced, then renamed
into place; only then does `latest` move. A crash at any moment leaves the previous
checkpoint loadable, and a directory without a valid manifest is never loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_file
from torch import nn

from aiayn.errors import CheckpointError
from aiayn.files import fsync_path, sha256_of, write_atomic
from aiayn.tokenizer import check_contract

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE, TRAINER_FILE, MANIFEST_FILE = "model.safetensors", "trainer.pt", "manifest.json"
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
)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def weights_snapshot(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """A host copy of `module`'s weights for safetensors, each tensor once, and its metadata.

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
        tensors[keep] = state[keep].detach().to("cpu", copy=True).contiguous()
        metadata.update({name: keep for name in tied})
    return tensors, metadata or None


def _host_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory: what the next step will not change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def read_manifest(ckpt: Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError if it is incomplete or corrupt."""
    try:
        manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{ckpt} has no readable {MANIFEST_FILE} ({exc})") from None
    for name, meta in manifest.get("files", {}).items():
        path = ckpt / name
        if not path.is_file() or path.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{path} is missing or truncated")
        if verify and sha256_of(path) != meta["sha256"]:
            raise CheckpointError(f"{path} does not match its checksum: the file is corrupt")
    return manifest


def check_architecture(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Raise if the checkpoint was written by a model of another shape."""
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


class CheckpointManager:
    """Saves and finds checkpoints of one run. Every rank calls it; only writers write.

    Retention: the newest `keep_last`, every step that is a multiple of `keep_every`, and the
    `keep_best` with the best `best_metric` as recorded in their manifests (so the choice
    survives restarts). The checkpoint `latest` names is never deleted.
    """

    def __init__(
        self,
        run_dir: str | Path,
        every_steps: int,
        keep_last: int,
        is_writer: bool,
        *,
        keep_every: int = 0,
        keep_best: int = 0,
        best_metric: str = "valid/loss",
        higher_is_better: bool = False,
        async_save: bool = False,
    ):
        self.root = Path(run_dir) / "checkpoints"
        self.async_save = async_save
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.is_writer = is_writer
        self.keep_every, self.keep_best = keep_every, keep_best
        self.best_metric, self.higher_is_better = best_metric, higher_is_better

    @classmethod
    def from_config(cls, run_dir: str | Path, cfg: Any, is_writer: bool) -> CheckpointManager:
        """The manager a CheckpointConfig describes."""
        return cls(
            run_dir,
            cfg.every_steps,
            cfg.keep_last,
            is_writer,
            keep_every=cfg.keep_every,
            keep_best=cfg.keep_best,
            best_metric=cfg.best_metric,
            higher_is_better=cfg.higher_is_better,
            async_save=cfg.async_save,
        )

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def checkpoints(self) -> list[Path]:
        """Complete-looking checkpoint directories, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.name[5:].isdigit() and p.is_dir())

    def latest(self) -> Path | None:
        """The newest checkpoint that validates; broken ones are skipped with a warning."""
        for ckpt in reversed(self.checkpoints()):
            try:
                read_manifest(ckpt)
                return ckpt
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", ckpt.name, exc)
        return None

    def save(
        self,
        step: int,
        engine,
        trainer_state: dict[str, Any],
        meta: dict[str, Any],
        env=None,
    ) -> Path | None:
        """Write checkpoint `step` atomically; return its path (None on non-writers).

        Every rank must call it: a sharded engine (DeepSpeed ZeRO) writes each rank's
        partition into the same temporary directory before the writer adds the consolidated
        weights, the trainer state and the manifest that covers every file. With
        `async_save` the writer's part runs in a background thread on a host copy of the
        state, and the path exists once `wait()` returns.
        """
        started = time.perf_counter()
        self._join()  # one write in flight at a time
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        if self.is_writer:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier = env.barrier if env is not None else lambda: None
        barrier()
        engine.save_shards(tmp)
        weights = None
        with engine.full_module() as module:  # a collective under ZeRO-3
            if self.is_writer:
                weights = weights_snapshot(module)
        barrier()  # every rank's shards are on disk
        if self.is_writer and self.async_save:
            state = _host_copy(trainer_state)  # the next step changes the optimizer in place
            args = (step, tmp, weights, state, meta, started)
            self._writer = threading.Thread(target=self._write_in_background, args=args)
            self._writer.start()  # not a daemon: an exiting process finishes the write
            log.info("checkpoint %d: training blocked %.2fs", step, time.perf_counter() - started)
        elif self.is_writer:
            self._finish(step, tmp, weights, trainer_state, meta, started)
        if not self.async_save:
            # Nobody leaves before the checkpoint is complete: a rank that exits after a
            # preemption save must not let a scheduler end the job while rank 0 still writes.
            barrier()
        return final if self.is_writer else None

    def wait(self, env=None) -> None:
        """Return once every checkpoint this process started is on disk, on every rank."""
        self._join()
        if env is not None:
            env.barrier()

    def _join(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise CheckpointError(
                f"the background checkpoint write failed ({failure!r}); the previous "
                "checkpoint is intact. Check the disk (space, permissions) and re-run."
            ) from failure

    def _write_in_background(self, *args) -> None:
        try:
            self._finish(*args)
        except BaseException as exc:  # reported by the next save or wait()
            self._failure = exc

    def _finish(
        self,
        step: int,
        tmp: Path,
        weights: tuple,
        trainer_state: dict[str, Any],
        meta: dict[str, Any],
        started: float,
    ) -> Path:
        """The writer's part: weights, trainer state, fsync, manifest, rename, pointer."""
        final = self.root / step_dir_name(step)
        tensors, metadata = weights
        save_file(tensors, str(tmp / MODEL_FILE), metadata=metadata)
        torch.save(trainer_state, tmp / TRAINER_FILE)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())
            name = path.relative_to(tmp).as_posix()
            files[name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
        for folder in sorted({p.parent for p in tmp.rglob("*")}, reverse=True):
            fsync_path(folder)
        manifest = {"format": FORMAT_VERSION, "step": step, "files": files, **meta}
        write_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
        if final.exists():  # a re-save of the same step (e.g. after a resume at the end)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.root)
        write_atomic(self.root / "latest", final.name + "\n")
        self._prune()
        log.info("saved %s in %.2fs", final, time.perf_counter() - started)
        return final

    def best(self) -> list[Path]:
        """Checkpoints that recorded `best_metric`, best first (the later one on a tie)."""
        scored = []
        for ckpt in self.checkpoints():
            try:
                value = json.loads((ckpt / MANIFEST_FILE).read_text())["metrics"][self.best_metric]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # saved without a validation at its step, or incomplete
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            scored.append((value if self.higher_is_better else -value, ckpt))
        return [ckpt for _, ckpt in sorted(scored, reverse=True)]

    def _pointed(self) -> Path | None:
        try:
            return self.root / (self.root / "latest").read_text().strip()
        except OSError:
            return None

    def _prune(self) -> None:
        for stale in self.root.glob(".tmp-*"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        ckpts = self.checkpoints()
        keep = set(ckpts[-self.keep_last :]) | {self._pointed()}
        if self.keep_every:
            keep |= {c for c in ckpts if step_of(c) % self.keep_every == 0}
        if self.keep_best:
            keep |= set(self.best()[: self.keep_best])
        for old in ckpts:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.rsplit("_", 1)[1])


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the latest valid one of a run directory; verified."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        read_manifest(path)  # a corrupt checkpoint named explicitly is an error, not a fallback
        return path
    for run_dir in (path, path.parent):  # a run_dir, or its checkpoints/ folder
        found = CheckpointManager(run_dir, 1, 1, is_writer=False).latest()
        if found is not None:
            return found
    raise CheckpointError(
        f"no valid checkpoint at {path}: pass a run_dir holding checkpoints/ or a "
        "checkpoints/step_XXXXXXXX directory"
    )


def load_checkpoint(
    ckpt: Path,
    model: nn.Module | None,
    *,
    expect_model: Any = None,
    tokenizer: Any = None,
    verify: bool = True,
    with_trainer_state: bool = True,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Load weights into `model`; return (trainer_state, manifest). Never unpickles code.

    `model=None` loads no weights: a sharded engine restores them from its own shards.

    `expect_model` (a ModelConfig) and `tokenizer` are checked against what the checkpoint
    recorded before any tensor is read, so a mismatch names its fields instead of a shape.
    `verify=False` skips the checksums for a checkpoint that `CheckpointManager.latest` or
    `resolve_checkpoint` has just verified: hashing the weights twice doubles the load time.
    `with_trainer_state=False` (inference) reads no optimizer state and returns None for it;
    averaged checkpoints have none.
    """
    manifest = read_manifest(ckpt, verify=verify)
    if expect_model is not None:
        check_architecture(manifest["config"]["model"], dataclasses.asdict(expect_model), str(ckpt))
    if tokenizer is not None:
        check_contract(manifest["tokenizer"], tokenizer, where=str(ckpt))
    missing, unexpected = [], []
    try:
        if model is not None:
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
    trainer_state = torch.load(ckpt / TRAINER_FILE, map_location="cpu", weights_only=True)
    return trainer_state, manifest
