"""The checkpoint manager: the one object the training loop talks to about checkpoints.

It owns when to save (`due`), what a training checkpoint holds (`track`, `save_step`: the
engine, data loader, RNG streams and counters it tracks, and the manifest's metadata), which
checkpoints are kept and which is the best (checkpoint/retention.py), and finding them. It
delegates the rest: writing a checkpoint atomically, every rank its part, to
checkpoint/writer.py; choosing the checkpoint a run resumes from, and restoring the run from
it, to checkpoint/resume.py. The files themselves are checkpoint/format.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from aiayn import metric_names
from aiayn.checkpoint import rng_file
from aiayn.checkpoint.failures import FailedSaves
from aiayn.checkpoint.format import CHECKPOINTS_DIR, checkpoints_in, latest_valid
from aiayn.checkpoint.resume import load_state, restore_rng, resume_point
from aiayn.checkpoint.retention import Retention
from aiayn.checkpoint.rng_file import RNG_FILE
from aiayn.checkpoint.writer import Marks, Writer, latest_named
from aiayn.config import Config
from aiayn.data import Loader
from aiayn.distributed.env import DistEnv
from aiayn.engine import Engine
from aiayn.errors import TrainingError
from aiayn.runtime import io_counts
from aiayn.runtime.seeding import rng_state
from aiayn.runtime.startup import StartupTimes
from aiayn.tokenizer import Tokenizer

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

    cfg: Config
    tok: Tokenizer
    engine: Engine
    loader: Loader
    env: DistEnv
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
        io_counts.watch(self.root)  # what a save and a restart open and list, logged
        self._resume_io: dict[str, int] | None = None
        self.failures = FailedSaves(max_failed_saves)
        self.every_steps = every_steps
        self.retention = Retention(keep_last, keep_every, keep_best, best_metric, higher_is_better)
        self._writer = Writer(self.root, is_writer, async_save, self.failures, self.retention)

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

    @property
    def is_writer(self) -> bool:
        return self._writer.is_writer

    @property
    def async_save(self) -> bool:
        return self._writer.async_save

    def due(self, step: int, last: bool = False) -> bool:
        """Whether the end of `step` is a save point: every checkpoint.every_steps, and the
        run's last step (train.max_steps reached, or an early stop). Every rank asks after every
        step and gets the same answer."""
        return step % self.every_steps == 0 or last

    def checkpoints(self) -> list[Path]:
        """Complete-looking checkpoint directories, oldest first."""
        return checkpoints_in(self.root)

    def latest(self) -> Path | None:
        """The newest checkpoint that validates; broken ones are skipped with a warning."""
        return latest_valid(self.root)

    def named_latest(self) -> Path | None:
        """The checkpoint `latest` names, unverified: for a message, where hashing a
        checkpoint on every rank would cost more than the message is worth."""
        return latest_named(self.root)

    def best(self) -> list[Path]:
        """Checkpoints that recorded `best_metric`, best first (the later one on a tie)."""
        return self.retention.ranked(self.checkpoints())

    # ---- a training run's checkpoints ----------------------------------------------------

    def track(self, cfg, tok, engine, loader, env, init=None) -> None:
        """The run whose state `save_step` saves and `restore` restores; `init`, its source's
        provenance, goes into every manifest."""
        self._run = Tracked(cfg, tok, engine, loader, env, init)

    def resume_point(self, resume: str, env: DistEnv | None = None) -> Path | None:
        """The checkpoint a run starts from: None for a new run (checkpoint.resume). Each
        rank verifies its share of it, and all get the same verdict (checkpoint/resume.py)."""
        before = io_counts.counts()
        found = resume_point(self.root, resume, env)
        self._resume_io = io_counts.since(before)  # the restart's first part (its log line)
        return found

    def restore(self, ckpt: Path, startup: StartupTimes | None = None) -> Progress:
        """Every rank restores the tracked run from `ckpt` (found by `resume_point`, which
        verified its checksums) and gets back the counters to continue from. `startup` times
        the checkpoint's load and the data position apart (the start-up line). How:
        checkpoint/resume.py."""
        run = self._run
        before = io_counts.counts()
        startup = startup or StartupTimes.of_this_process()
        trainer_state = load_state(run, ckpt, startup)
        progress = Progress.from_state(trainer_state["progress"])
        restore_rng(run, ckpt, trainer_state, progress.step)
        log.info("resuming from %s", ckpt)
        # resume_point's choice and this load; each rank's must not grow with W
        # (tests/distributed/test_topology.py compares W = 2 and 4).
        io_counts.log_line(run.env, "at the restart", before, self._resume_io)
        return progress

    def save_step(
        self, step: int, progress: Progress, valid: dict[str, float] | None = None
    ) -> Path | None:
        """Every rank saves the tracked run at `step`; `valid` (this step's validation
        metrics) goes into the manifest, so that keeping the best survives restarts."""
        run = self._run
        since = io_counts.counts()
        marks = Marks()  # the loop is blocked from here: the log line counts all of it
        if run.engine.replicas_differ(run.env):
            raise TrainingError(
                f"parameters differ between data-parallel ranks at step {step}: not saving. This "
                "is a bug (a rank stepped without the others); please report it with train.log."
            )
        state = {
            "engine": run.engine.state_dict(),
            "data": run.loader.state_dict(),  # the same on every rank: the group's position
            "progress": vars(progress).copy(),
        }
        # Every rank's dropout stream, to rank 0, which writes them into one file in which
        # each rank reads its own at a resume (checkpoint/rng_file.py).
        rngs = run.env.gather_to_main(rng_state())
        files = {RNG_FILE: rng_file.encode(rngs)} if rngs is not None else {}
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
        saved = self.save(step, run.engine, state, meta, run.env, marks, files)
        # What each rank did until the save returned (an async save's write goes on after).
        io_counts.log_line(run.env, f"at the save of step {step}", since)
        return saved

    # ---- writing: checkpoint/writer.py ---------------------------------------------------

    def save(
        self,
        step: int,
        engine,
        trainer_state: dict[str, Any],
        meta: dict[str, Any],
        env=None,
        marks: Marks | None = None,
        files: dict[str, bytes] | None = None,
    ) -> Path | None:
        """Write checkpoint `step` of `engine` with `trainer_state` atomically; return its path
        (None on non-writers, and when the save failed). `save_step` calls it with the tracked
        run's state. `files`: small files the writer (rank 0) adds, name -> bytes.

        Every rank must call it, and every rank writes its share (checkpoint/writer.py says
        how). With `async_save` each rank writes in a background thread from host copies of
        its ranges, and the path exists once `wait()` returns. A write that fails on any rank
        (a full disk) fails the save on every rank: the partial directory is removed, `latest`
        keeps naming the previous checkpoint, and training goes on until
        checkpoint.max_failed_saves saves in a row have failed (checkpoint/failures.py says
        why).
        """
        return self._writer.save(step, engine, trainer_state, meta, env, marks, files)

    def before_update(self) -> None:
        """Call before each optimizer update: it must not change what an async save is still
        copying (on CUDA the copies run beside the step; the host does not wait)."""
        self._writer.before_update()

    def wait(self, env=None) -> None:
        """Return once every checkpoint this process started is on disk, on every rank;
        CheckpointError when the newest save failed: the run's last save (at its end, or
        before a preemption exit) must not be reported as done without its checkpoint."""
        self._writer.wait(env)

    def join_writes(self) -> None:
        """Wait for this process's background write to end, agreeing on nothing with the other
        ranks: for a run leaving on an error, whose run directory's lock must outlast it."""
        self._writer.join()
