"""The write protocol: how one checkpoint gets atomically onto disk, every rank writing its part.

Every rank takes part in a save, and every rank writes its share: a sharded engine (DeepSpeed
ZeRO) its partition, and each rank 1/W of the weights and of the trainer state's tensors, a byte
range of model.safetensors and trainer.safetensors each, hashed as it writes
(runtime/tensor_files.py). Once every rank's ranges are on disk, the writer (rank 0) adds the
rest of the trainer state, the manifest that covers every file, the rename and the `latest`
pointer, then applies the retention rules (checkpoint/retention.py) in a thread of its own.
With async_save each rank writes in a background thread from host copies of its ranges
(checkpoint/staging.py).

A write that fails on any rank (a full disk) fails the save on every rank: each stage ends in
one collective that tells every rank whether some rank failed, so no rank waits for one that
gave up. The partial directory is removed, `latest` keeps naming the previous checkpoint, and
training goes on until checkpoint.max_failed_saves saves in a row have failed
(checkpoint/failures.py says why). The files themselves are checkpoint/format.py's; what a save
holds and when it is due are checkpoint/manager.py's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from aiayn.checkpoint import staging
from aiayn.checkpoint.failures import FailedSaves, Seen, free_bytes, message
from aiayn.checkpoint.format import (
    EMA_FILE,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_FILE,
    TRAINER_FILE,
    TRAINER_TENSORS_FILE,
    checkpoints_in,
    split_tensors,
    step_dir_name,
)
from aiayn.checkpoint.retention import LATEST, Retention, pointed
from aiayn.engine.state import host_copy
from aiayn.errors import CheckpointError
from aiayn.runtime import io_counts
from aiayn.runtime.durable import fsync_path, sha256_of, write_atomic
from aiayn.runtime.tensor_files import TensorFile, slice_bytes, write_slices

log = logging.getLogger(__name__)


class Writer:
    """Writes the checkpoints of one run's checkpoints/ directory (`root`), one at a time, and
    keeps the count of saves that failed in a row (`failures`). Every rank has one; only the
    writer (rank 0, `is_writer`) writes the files no rank writes by range."""

    def __init__(
        self,
        root: Path,
        is_writer: bool,
        async_save: bool,
        failures: FailedSaves,
        retention: Retention,
    ):
        self.root = root
        self.is_writer = is_writer
        self.async_save = async_save
        self.failures = failures
        self.retention = retention
        self._thread: threading.Thread | None = None
        self._pending: int | None = None  # the step of an async write not yet joined, all ranks
        self._problem: tuple[BaseException, int] | None = None  # its failure and tensor bytes
        self._staging = staging.Staging()  # an async save's host copies
        self._retiring: threading.Thread | None = None  # deleting old checkpoints (rank 0)

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
        (None on non-writers, and when the save failed; with async_save the path exists once
        `wait()` returns). `files`: small files the writer adds (name -> bytes; rank 0's).
        Every rank must call it: the stages, and the collective that ends each, are the
        module docstring's."""
        marks = marks or Marks()  # where an async save's blocking time goes, for its log line
        started = marks.started
        self._join(env)  # one write in flight at a time; every rank learns how the last ended
        marks.add("previous write")
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"
        distributed = env is not None and env.distributed
        if distributed:
            env.save_group  # noqa: B018 (made by every rank's main thread, before a writer uses it)
        self._join_retention()
        problem = _attempt(self._make_tmp, tmp) if self.is_writer else None
        if self._settle(step, env, tmp, problem):
            return None
        marks.add("directory")
        written: list[Path] = []  # this rank's shard files, which it hashes
        problem = _attempt(lambda: written.extend(engine.save_shards(tmp)))
        marks.add("engine shards")
        rank, world = (env.rank, env.world_size) if distributed else (0, 1)
        skeleton, state_tensors = split_tensors(trainer_state)
        shares = self._shares(engine, state_tensors, rank, world, marks)
        nbytes = sum(slice_bytes(sl) for sl, _, _ in shares.values())
        marks.add("trainer tensors")
        if self._settle(step, env, tmp, problem, nbytes):  # every rank's shards are on disk
            return None
        marks.add("agreement")
        if self.is_writer:
            skeleton = self._staging.copy_tree(skeleton) if self.async_save else skeleton
        write = (step, tmp, shares, written, (skeleton, files or {}), meta, started, env)
        if self.async_save:
            self._write_later(write, nbytes, marks)
            return final if self.is_writer else None
        problem = _attempt(self._write, *write)
        # Nobody leaves before the checkpoint is complete: a rank that exits after a
        # preemption save must not let a scheduler end the job while rank 0 still writes.
        if self._settle(step, env, tmp, problem, nbytes):
            return None
        self.failures.succeeded()
        return final if self.is_writer else None

    def _shares(self, engine, state_tensors: dict, rank: int, world: int, marks: Marks) -> dict:
        """This rank's byte ranges of model.safetensors and trainer.safetensors, each file's
        name -> (its slices, lo, hi)."""
        if self.async_save:
            self._staging.begin()
        # A synchronous save writes before the state changes: from the tensors themselves,
        # brought to the host a part at a time, with no copy of the whole state.
        copy = self._staging.copy if self.async_save else _as_is
        shares = {}
        # A collective under ZeRO-3 (each weight gathered in turn, every rank taking part), so
        # that no rank holds the whole model: each keeps the parts in its range. train.ema's
        # average of the weights likewise, into a file of the same layout.
        for name, source in ((MODEL_FILE, engine.weights), (EMA_FILE, engine.ema_weights)):
            with source() as weights:
                if weights is None:  # no EMA
                    continue
                layout = TensorFile.of(weights.specs, weights.metadata)
                lo, hi = layout.share(rank, world)
                keep = host_copy if weights.transient and not self.async_save else copy
                parts = layout.slices(weights.each(layout.names), lo, hi, keep)
                shares[name] = (parts, lo, hi)
        marks.add("weights")
        layout = TensorFile.of(state_tensors, None)
        lo, hi = layout.share(rank, world)
        items = ((name, state_tensors[name]) for name in layout.names)
        shares[TRAINER_TENSORS_FILE] = (layout.slices(items, lo, hi, copy), lo, hi)
        return shares

    def _write_later(self, write: tuple, nbytes: int, marks: Marks) -> None:
        """Start an async save's write in a background thread, and say how long it held the
        loop. The next update changes the weights and moments in place: the write reads
        copies, queued here and made beside the next step (checkpoint/staging.py)."""
        step = write[0]
        args = (*write, self._staging.end(), nbytes)
        self._thread = threading.Thread(target=self._write_in_background, args=args)
        self._thread.start()  # not a daemon: an exiting process finishes the write
        marks.add("the rest")
        if self.is_writer:
            blocked = time.perf_counter() - marks.started
            log.info("checkpoint %d: training blocked %.3fs (%s)", step, blocked, marks)
        self._pending = step

    def before_update(self) -> None:
        """Call before each optimizer update: it must not change what an async save is still
        copying (on CUDA the copies run beside the step; the host does not wait)."""
        self._staging.guard()

    def wait(self, env=None) -> None:
        """Return once every checkpoint this process started is on disk, on every rank;
        CheckpointError when the newest save failed: the run's last save (at its end, or
        before a preemption exit) must not be reported as done without its checkpoint."""
        self._join(env)
        self._join_retention()
        if env is not None:
            env.barrier()
        self.failures.check_saved()

    def join(self) -> None:
        """Wait for the background write, if one runs; wait() or the next save settles it."""
        if self._thread is not None:
            self._thread.join()
        self._join_retention()

    def _join_retention(self) -> None:
        """Wait for the deletions of the last save's retention (started by the thread that
        finished that save: join the write first)."""
        if self._retiring is not None:
            self._retiring.join()
            self._retiring = None

    def _join(self, env) -> None:
        """Wait for the background write, then agree with every rank on how it ended. Every
        rank takes part (a collective) whenever an async save was started: all ranks know
        that, as they agreed on its first stages."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
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
        and hashed; then, once every rank's are (one gather to rank 0, over the writer threads'
        own group), the writer's: the rest."""
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
        # To rank 0 only, which writes the manifest: a gather to every rank would bring each
        # the W ranges it never reads. A rank's failure reaches the others through rank 0's,
        # at the collective that ends the save (_settle).
        seen = env.save_gather(mine) if env is not None else [mine]
        if problem is not None:
            raise problem
        if self.is_writer:
            failed = [(r, p) for r, (_, _, p) in enumerate(seen) if p is not None]
            if failed:
                raise CheckpointError(
                    f"rank {failed[0][0]} could not write its part: {failed[0][1]}"
                )
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
        text, disk_full = message(step, seen, self.root, latest_named(self.root))
        if exc is not None and not disk_full:  # not the usual cause: where it came from
            log.error("checkpoint step %d: the write failed", step, exc_info=exc)
        self.failures.failed(step, text)
        return True

    def _retire(self, saved: str) -> None:
        """The retention rules, after the save of `saved` (in their own thread): a failure
        here (`best` not written) is the log's, not the save's, which is complete."""
        try:
            with io_counts.uncounted():
                self.retention.after_save(self.root, checkpoints_in(self.root))
        except Exception:
            log.warning("after saving %s: deleting old checkpoints failed", saved, exc_info=True)

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
        skeleton: tuple[dict[str, Any], dict[str, bytes]],
        meta: dict[str, Any],
        started: float,
    ) -> Path:
        """The writer's part: the trainer state's rest and the small files (`skeleton`: both),
        fsync, manifest, rename, pointer. The files the ranks wrote by range, and their shard
        files, are synced and hashed already; the writer hashes the others (its trainer.pt and
        the small files)."""
        final = self.root / step_dir_name(step)
        # Our own file object: torch.save given a path leaves it open when a write fails, and
        # an open file keeps its space on a full disk after the partial directory is removed.
        skeleton, small = skeleton
        with open(tmp / TRAINER_FILE, "wb") as fh:
            torch.save(skeleton, fh)
        for name, data in small.items():
            (tmp / name).write_bytes(data)
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
        # Deleting old checkpoints (W shard files each under ZeRO) waits for nothing here: a
        # thread of its own, joined before the next save makes its directory (which the
        # retention's cleaning of stale .tmp- folders must not meet) and at wait().
        self._retiring = threading.Thread(target=self._retire, args=(final.name,))
        self._retiring.start()  # not a daemon: an exiting process finishes the deletions
        log.info("saved %s in %.2fs", final, time.perf_counter() - started)
        return final


def latest_named(root: Path) -> Path | None:
    """The checkpoint `latest` names, when it is there (unverified)."""
    found = pointed(root, LATEST)
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


class Marks:
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
