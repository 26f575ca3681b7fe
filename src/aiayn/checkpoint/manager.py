"""The checkpoint manager: when to save, what a save holds, where a run resumes, retention.

The loop says "save at this step" (`save_step`) and "restore" (`restore`); the manager builds
the state from what it tracks (engine, data loader, RNG streams, counters), writes it
atomically, and on a restart decides which checkpoint to resume from and how: in the engine's
own format when the topology is unchanged (bitwise), or resharded by parameter name when it
changed (checkpoint/reshard.py). The files themselves are checkpoint/format.py's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from aiayn import metric_names
from aiayn.checkpoint import reshard, staging
from aiayn.checkpoint.failures import FailedSaves, Seen, free_bytes, message
from aiayn.checkpoint.format import (
    CHECKPOINTS_DIR,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_FILE,
    TRAINER_FILE,
    TRAINER_TENSORS_FILE,
    checkpoints_in,
    latest_valid,
    load_checkpoint,
    read_manifest,
    read_stored,
    split_tensors,
    step_dir_name,
)
from aiayn.checkpoint.retention import LATEST, Retention, pointed
from aiayn.checkpoint.tensor_files import TensorFile, slice_bytes, write_slices
from aiayn.distributed.env import DistEnv
from aiayn.engine.state import host_copy, trainable
from aiayn.errors import CheckpointError, TrainingError
from aiayn.files import fsync_path, sha256_of, size_text, write_atomic
from aiayn.seeding import load_rng_state, rng_state, seed_everything
from aiayn.startup import StartupTimes

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Counters that survive a restart."""

    step: int = 0
    tokens: int = 0
    # Early stopping (train.patience): the best value of checkpoint.best_metric so far, the
    # step it was reached at, and the validations since without an improvement.
    best_value: float | None = None
    best_step: int = 0
    since_best: int = 0

    @classmethod
    def from_state(cls, saved: dict[str, Any]) -> Progress:
        # Older checkpoints also hold wall_seconds, which nothing reads.
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


@dataclass
class Tracked:
    """What a training checkpoint holds the state of (`CheckpointManager.track`)."""

    cfg: Any  # Config
    tok: Any  # Tokenizer
    engine: Any  # distributed.engine.Engine
    loader: Any  # aiayn.data.Loader (data/loader_protocol.py)
    env: Any  # DistEnv
    init: dict[str, Any] | None = None  # where the run started from (init.source), recorded


class CheckpointManager:
    """Saves and finds checkpoints of one run. Every rank calls it; only writers write.
    Which checkpoints are kept, and which is the best: checkpoint/retention.py."""

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
        max_failed_saves: int = 3,
    ):
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.async_save = async_save
        self._writer: threading.Thread | None = None
        self._pending: int | None = None  # the step of an async write not yet joined, all ranks
        self._problem: tuple[BaseException, int] | None = None  # its failure and tensor bytes
        self._staging = staging.Staging()  # an async save's host copies
        self.failures = FailedSaves(max_failed_saves)
        self.every_steps = every_steps
        self.is_writer = is_writer
        self.retention = Retention(keep_last, keep_every, keep_best, best_metric, higher_is_better)

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
            max_failed_saves=cfg.max_failed_saves,
        )

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def checkpoints(self) -> list[Path]:
        """Complete-looking checkpoint directories, oldest first."""
        return checkpoints_in(self.root)

    def latest(self) -> Path | None:
        """The newest checkpoint that validates; broken ones are skipped with a warning."""
        return latest_valid(self.root)

    # ---- a training run's checkpoints ----------------------------------------------------

    def track(self, cfg, tok, engine, loader, env, init=None) -> None:
        """The run whose state `save_step` saves and `restore` restores; `init`, its source's
        provenance, goes into every manifest."""
        self._run = Tracked(cfg, tok, engine, loader, env, init)

    def resume_point(self, resume: str, env: DistEnv | None = None) -> Path | None:
        """The checkpoint a run starts from: None for a new run (checkpoint.resume).

        Rank 0 alone lists the checkpoints and verifies their checksums, and every rank gets
        its verdict: the same checkpoint to resume from, or the same error. Verifying on every
        rank would read the whole checkpoint, every ZeRO shard, once per rank from shared
        storage, and let ranks that see the directory differently pick different steps. Each
        rank then checks that it sees that checkpoint's files at their recorded sizes (no
        hashing): ranks whose run_dir is not the same storage stop together, saying so."""
        if env is None or not env.distributed:
            return self._choose(resume)
        name = env.decide(lambda: self._chosen_name(resume))
        ckpt = None if name is None else self.root / name
        problem = None
        if ckpt is not None:
            try:
                read_manifest(ckpt, verify=False)
            except CheckpointError as exc:
                problem = str(exc)
        if not env.sum([float(problem is not None)])[0]:
            return ckpt
        # Only when some rank failed: which, and why (a gather is O(W) on every rank).
        problems = [(rank, p) for rank, p in enumerate(env.gather(problem)) if p is not None]
        rank, what = problems[0]
        raise CheckpointError(
            f"rank 0 verified {name} to resume from, but {len(problems)} rank(s) cannot "
            f"read it (rank {rank}: {what}). Every rank must see the same run_dir: put it "
            "on storage all nodes share"
        )

    def _chosen_name(self, resume: str) -> str | None:
        try:
            chosen = self._choose(resume)
        except OSError as exc:  # storage rank 0 cannot read: every rank stops with its message
            raise CheckpointError(str(exc)) from None
        return None if chosen is None else chosen.name

    def _choose(self, resume: str) -> Path | None:
        existing = self.checkpoints()
        if resume == "never":
            if existing:
                raise CheckpointError(
                    f"{self.root.parent} already holds checkpoints ({existing[-1].name}) and "
                    "checkpoint.resume=never: choose a new run_dir, or delete the old run first"
                )
            return None
        latest = self.latest()
        if existing and latest is None:
            raise CheckpointError(
                f"{self.root} holds checkpoints but none is valid; move them away to start over"
            )
        return latest

    def named_latest(self) -> Path | None:
        """The checkpoint `latest` names, unverified: for a message, where hashing a
        checkpoint on every rank would cost more than the message is worth."""
        return self._pointed_checkpoint()

    def restore(self, ckpt: Path, startup: StartupTimes | None = None) -> Progress:
        """Every rank restores the tracked run from `ckpt` (found by `resume_point`, which
        verified its checksums) and gets back the counters to continue from. `startup` times
        the checkpoint's load and the data position apart (the start-up line)."""
        run = self._run
        cfg, env = run.cfg, run.env
        startup = startup or StartupTimes.of_this_process()
        with startup.phase("checkpoint load"):
            # The engine's tensors (Adam's moments) stay unread until it is known whether they
            # are loaded whole or resharded, when each rank reads only its part.
            trainer_state, manifest = load_checkpoint(
                ckpt,
                None,
                expect_model=cfg.model,
                tokenizer=run.tok,
                verify=False,
                lazy=lambda key: key.startswith("/engine/"),
            )
            self._load_engine(ckpt, trainer_state, manifest)
        with startup.phase("data position"):
            run.loader.load_state_dict(trainer_state["data"])  # the position of all ranks
        progress = Progress.from_state(trainer_state["progress"])
        rngs = trainer_state["rng"]
        if len(rngs) == env.world_size:
            load_rng_state(rngs[env.rank])
        else:  # another world size: fresh, distinct streams, derived from the step
            log.warning(
                "checkpoint has RNG states of %d ranks, this run has %d: dropout reseeded",
                len(rngs),
                env.world_size,
            )
            seed_everything(cfg.train.seed + 1_000_003 * env.rank + progress.step)
        log.info("resuming from %s", ckpt)
        return progress

    def _load_engine(self, ckpt: Path, trainer_state: dict, manifest: dict) -> None:
        """Weights and engine state: in the engine's own format when the topology is
        unchanged (bitwise), else resharded by parameter name."""
        cfg, env, engine = self._run.cfg, self._run.env, self._run.engine
        saved = reshard.Topology.of_checkpoint(manifest, trainer_state)
        here = reshard.Topology.of(cfg, env.world_size)
        if saved.same_layout(here):  # the engine reads its own format: a bitwise resume
            if engine.loads_weights:
                load_checkpoint(ckpt, engine.module, verify=False, with_trainer_state=False)
            engine.load_state_dict(read_stored(trainer_state["engine"], ckpt), ckpt)
        else:  # weights and optimizer state resharded by parameter name
            log.warning(
                "checkpoint written by %s, resuming on %s: resharding its state", saved, here
            )
            shapes = {name: p.shape for name, p in trainable(engine.module)}
            with reshard.read(ckpt, trainer_state, saved, shapes) as state:
                engine.load_portable(state)
            # Each rank read its share of the state, not the whole of it (ZeRO): say so.
            busiest = env.max([float(state.bytes_read)])[0] if env.distributed else state.bytes_read
            log.info(
                "resharding read %s of the checkpoint's %s of weights and optimizer state on the "
                "busiest rank",
                size_text(busiest),
                size_text(state.bytes_stored),
            )

    def save_step(
        self, step: int, progress: Progress, valid: dict[str, float] | None = None
    ) -> Path | None:
        """Every rank saves the tracked run at `step`; `valid` (this step's validation
        metrics) goes into the manifest, so that keeping the best survives restarts."""
        run = self._run
        marks = _Marks()  # the loop is blocked from here: the log line counts all of it
        if run.engine.replicas_differ(run.env):
            raise TrainingError(
                f"parameters differ between data-parallel ranks at step {step}: not saving. This "
                "is a bug (a rank stepped without the others); please report it with train.log."
            )
        state = {
            "engine": run.engine.state_dict(),
            "data": run.loader.state_dict(),  # the same on every rank: the group's position
            "rng": run.env.gather(rng_state()),  # every rank's dropout stream, in rank order
            "progress": vars(progress).copy(),
        }
        marks.add("replica check and state")
        meta = {
            "config": run.cfg.to_dict(),
            "tokenizer": run.tok.contract(),
            "world_size": run.env.world_size,
        }
        if run.init is not None:
            meta["init"] = run.init
        if valid:
            meta["metrics"] = {metric_names.tag(k): v for k, v in valid.items()}
        return self.save(step, run.engine, state, meta, run.env, marks)

    # ---- writing ----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        engine,
        trainer_state: dict[str, Any],
        meta: dict[str, Any],
        env=None,
        marks: _Marks | None = None,
    ) -> Path | None:
        """Write checkpoint `step` of `engine` with `trainer_state` atomically; return its path
        (None on non-writers, and when the save failed). `save_step` calls it with the tracked
        run's state.

        Every rank must call it, and every rank writes its share: a sharded engine (DeepSpeed
        ZeRO) its partition, and each rank 1/W of the weights and of the trainer state's
        tensors, a byte range of model.safetensors and trainer.safetensors each, hashed as it
        writes (checkpoint/tensor_files.py). Once every rank's ranges are on disk, the writer
        (rank 0) adds the rest of the trainer state, the manifest that covers every file, and
        the rename. With `async_save` each rank writes in a background thread from host copies
        of its ranges, and the path exists once `wait()` returns.

        A write that fails on any rank (a full disk) fails the save on every rank: each stage
        ends in one collective that tells every rank whether some rank failed, so no rank
        waits for one that gave up. The partial directory is removed, `latest` keeps naming
        the previous checkpoint, and training goes on until checkpoint.max_failed_saves saves
        in a row have failed (checkpoint/failures.py says why).
        """
        marks = marks or _Marks()  # where an async save's blocking time goes, for its log line
        started = marks.started
        self._join(env)  # one write in flight at a time; every rank learns how the last ended
        marks.add("previous write")
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        distributed = env is not None and env.distributed
        if distributed:
            env.save_group  # noqa: B018 (made by every rank's main thread, before a writer uses it)
        problem = _attempt(self._make_tmp, tmp) if self.is_writer else None
        if self._settle(step, env, tmp, problem):
            return None
        marks.add("directory")
        written: list[Path] = []  # this rank's shard files, which it hashes
        problem = _attempt(lambda: written.extend(engine.save_shards(tmp)))
        marks.add("engine shards")
        rank, world = (env.rank, env.world_size) if distributed else (0, 1)
        skeleton, state_tensors = split_tensors(trainer_state)
        if self.async_save:
            self._staging.begin()
        # A synchronous save writes before the state changes: from the tensors themselves,
        # brought to the host a part at a time, with no copy of the whole state.
        copy = self._staging.copy if self.async_save else _as_is
        shares = {}
        # A collective under ZeRO-3 (each weight gathered in turn, every rank taking part), so
        # that no rank holds the whole model: each keeps the parts in its range.
        with engine.weights() as weights:
            layout = TensorFile.of(weights.specs, weights.metadata)
            lo, hi = layout.share(rank, world)
            keep = host_copy if weights.transient and not self.async_save else copy
            parts = layout.slices(weights.each(layout.names), lo, hi, keep)
            shares[MODEL_FILE] = (parts, lo, hi)
        marks.add("weights")
        layout = TensorFile.of(state_tensors, None)
        lo, hi = layout.share(rank, world)
        items = ((name, state_tensors[name]) for name in layout.names)
        shares[TRAINER_TENSORS_FILE] = (layout.slices(items, lo, hi, copy), lo, hi)
        nbytes = sum(slice_bytes(sl) for sl, _, _ in shares.values())
        marks.add("trainer tensors")
        if self._settle(step, env, tmp, problem, nbytes):  # every rank's shards are on disk
            return None
        marks.add("agreement")
        if self.is_writer:
            skeleton = self._staging.copy_tree(skeleton) if self.async_save else skeleton
        write = (step, tmp, shares, written, skeleton, meta, started, env)
        if self.async_save:
            # The next update changes the weights and moments in place: the write reads
            # copies, queued here and made beside the next step (checkpoint/staging.py).
            args = (*write, self._staging.end(), nbytes)
            self._writer = threading.Thread(target=self._write_in_background, args=args)
            self._writer.start()  # not a daemon: an exiting process finishes the write
            marks.add("the rest")
            if self.is_writer:
                blocked = time.perf_counter() - started
                log.info("checkpoint %d: training blocked %.3fs (%s)", step, blocked, marks)
            self._pending = step
            return final if self.is_writer else None
        problem = _attempt(self._write, *write)
        # Nobody leaves before the checkpoint is complete: a rank that exits after a
        # preemption save must not let a scheduler end the job while rank 0 still writes.
        if self._settle(step, env, tmp, problem, nbytes):
            return None
        self.failures.succeeded()
        return final if self.is_writer else None

    def before_update(self) -> None:
        """Call before each optimizer update: it must not change what an async save is still
        copying (on CUDA the copies run beside the step; the host does not wait)."""
        self._staging.guard()

    def wait(self, env=None) -> None:
        """Return once every checkpoint this process started is on disk, on every rank;
        CheckpointError when the newest save failed: the run's last save (at its end, or
        before a preemption exit) must not be reported as done without its checkpoint."""
        self._join(env)
        if env is not None:
            env.barrier()
        self.failures.check_saved()

    def _join(self, env) -> None:
        """Wait for the background write, then agree with every rank on how it ended. Every
        rank takes part (a collective) whenever an async save was started: all ranks know
        that, as they agreed on its first stages."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        problem, self._problem = self._problem, None
        exc, nbytes = problem if problem is not None else (None, 0)
        # The writer thread removed its partial directory itself: nothing to discard here.
        if not self._settle(step, env, None, exc, nbytes):
            self.failures.succeeded()

    def _write_in_background(self, *args) -> None:
        *write, copied, nbytes = args
        try:
            staging.wait(copied)
            self._write(*write)
        except Exception as exc:  # agreed on by every rank at the next save or wait()
            if self.is_writer:
                shutil.rmtree(write[1], ignore_errors=True)
            self._problem = exc, nbytes

    def _write(self, step, tmp, shares, written, skeleton, meta, started, env) -> None:
        """Every rank's part: its byte ranges on disk and hashed, and its shard files synced
        and hashed; then, once every rank's are (one gather, over the writer threads' own
        group), the writer's: the rest."""
        ranges, hashed, problem = {}, {}, None
        try:
            for name, (slices, lo, hi) in shares.items():
                ranges[name] = write_slices(tmp / name, slices, lo, hi)
                slices.clear()  # written: its host copies (a ZeRO-3 share) go before hashing
            for path in written:
                with open(path, "rb+") as fh:
                    os.fsync(fh.fileno())
                entry = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
                hashed[path.relative_to(tmp).as_posix()] = entry
        except Exception as exc:  # still reach the gather: the others wait there
            problem = exc
        mine = (ranges, hashed, problem and f"{type(problem).__name__}: {problem}")
        seen = env.save_gather(mine) if env is not None else [mine]
        if problem is not None:
            raise problem
        failed = [(r, p) for r, (_, _, p) in enumerate(seen) if p is not None]
        if failed:
            raise CheckpointError(f"rank {failed[0][0]} could not write its part: {failed[0][1]}")
        if self.is_writer:
            files = {name: [got[name] for got, _, _ in seen] for name in shares}
            entries = {name: entry for _, own, _ in seen for name, entry in own.items()}
            self._finish(step, tmp, files, entries, skeleton, meta, started)

    def _settle(
        self, step: int, env, tmp: Path | None, exc: BaseException | None, nbytes: int = 0
    ) -> bool:
        """Whether save `step` failed on some rank, decided by one collective on every rank
        (where a barrier would be). After a failure the writer removes `tmp`, and a second
        collective shares what each rank saw, so that every rank records the same failure:
        the same message, and the same count towards max_failed_saves."""
        failed = exc is not None
        if env is not None and env.distributed:
            failed = env.sum([float(failed)])[0] > 0
        if not failed:
            return False
        mine = Seen.of(env.rank if env is not None else 0, exc, nbytes)
        if self.is_writer:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            mine.free_bytes = free_bytes(self.root)  # what is free once the partial files went
        seen = env.gather(mine) if env is not None and env.distributed else [mine]
        text, disk_full = message(step, seen, self.root, self._pointed_checkpoint())
        if exc is not None and not disk_full:  # not the usual cause: where it came from
            log.error("checkpoint step %d: the write failed", step, exc_info=exc)
        self.failures.failed(step, text)
        return True

    def _make_tmp(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def _finish(
        self,
        step: int,
        tmp: Path,
        ranges: dict[str, list],
        hashed: dict[str, dict],
        skeleton: dict[str, Any],
        meta: dict[str, Any],
        started: float,
    ) -> Path:
        """The writer's part: the trainer state's rest, fsync, manifest, rename, pointer. The
        files the ranks wrote by range, and their shard files, are synced and hashed already;
        the writer hashes the others (its trainer.pt)."""
        final = self.root / step_dir_name(step)
        # Our own file object: torch.save given a path leaves it open when a write fails, and
        # an open file keeps its space on a full disk after the partial directory is removed.
        with open(tmp / TRAINER_FILE, "wb") as fh:
            torch.save(skeleton, fh)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            name = path.relative_to(tmp).as_posix()
            if name in ranges:  # synced by the ranks that wrote it
                files[name] = _range_entry(path, ranges[name])
                continue
            if name in hashed:
                files[name] = hashed[name]
                continue
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())
            files[name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
        for folder in sorted({p.parent for p in tmp.rglob("*")}, reverse=True):
            fsync_path(folder)
        manifest = {"format": FORMAT_VERSION, "step": step, "files": files, **meta}
        write_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
        if final.exists():  # a re-save of the same step (e.g. after a resume at the end)
            shutil.rmtree(final)
        os.replace(tmp, final)
        try:
            fsync_path(self.root)
            write_atomic(self.root / LATEST, final.name + "\n")
        except BaseException:
            # A resume takes the newest valid directory: one that `latest` does not name yet
            # must go too, or the previous checkpoint would not be the one a restart finds.
            shutil.rmtree(final, ignore_errors=True)
            raise
        self.retention.after_save(self.root, self.checkpoints())
        log.info("saved %s in %.2fs", final, time.perf_counter() - started)
        return final

    def best(self) -> list[Path]:
        """Checkpoints that recorded `best_metric`, best first (the later one on a tie)."""
        return self.retention.ranked(self.checkpoints())

    def _pointed(self) -> Path | None:
        return pointed(self.root, LATEST)

    def _pointed_checkpoint(self) -> Path | None:
        """The checkpoint `latest` names, when it is there."""
        found = self._pointed()
        return found if found is not None and found.is_dir() else None


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _range_entry(path: Path, ranges: list) -> dict[str, Any]:
    """A file the ranks wrote by range: its ranges' sha256, or its own where one rank wrote
    it all (what checkpoints had before, and what every tool reads)."""
    size = path.stat().st_size
    ranges = [r for r in ranges if r[0] < r[1]]  # rank 0's holds the header: never all empty
    if len(ranges) == 1:
        return {"bytes": size, "sha256": ranges[0][2]}
    return {"bytes": size, "sha256_ranges": ranges}


class _Marks:
    """Seconds between successive marks, for a log line: "previous write 0.000, ..."."""

    def __init__(self):
        self.started = self._last = time.perf_counter()
        self._spans: list[tuple[str, float]] = []

    def add(self, name: str) -> None:
        now = time.perf_counter()
        self._spans.append((name, now - self._last))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.3f}" for name, seconds in self._spans)


def _attempt(action, *args) -> Exception | None:
    """What `action(*args)` raised, if anything: a rank that fails a stage of a save still
    reaches the collective that ends it, where every rank learns of the failure."""
    try:
        action(*args)
    except Exception as exc:
        return exc
    return None
