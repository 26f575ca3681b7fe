"""Resuming a run: which checkpoint it starts from, and restoring the run's state from it.

`resume_point` chooses the checkpoint (checkpoint.resume): each rank verifies its share of it
and all get the same verdict. `load_state` and `restore_rng` restore what a training checkpoint
holds into the run the manager tracks (checkpoint/manager.py's Tracked): the weights and engine
state in the engine's own format when the topology is unchanged (bitwise), or resharded by
parameter name when it changed (checkpoint/reshard.py); the data position; the RNG streams.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors import safe_open

from aiayn.checkpoint import compat, reshard, rng_file
from aiayn.checkpoint.format import (
    EMA_FILE,
    MANIFEST_FILE,
    checkpoints_in,
    latest_valid,
    load_checkpoint,
    read_stored,
)
from aiayn.distributed.env import DistEnv
from aiayn.engine.registry import shard_rank, topology
from aiayn.engine.state import whole_shapes
from aiayn.errors import CheckpointError
from aiayn.runtime.durable import size_text
from aiayn.runtime.seeding import load_rng_state, seed_everything
from aiayn.runtime.startup import StartupTimes
from aiayn.runtime.verify_share import verify_share

log = logging.getLogger(__name__)


def resume_point(root: Path, resume: str, env: DistEnv | None = None) -> Path | None:
    """The checkpoint in `root` (a run's checkpoints/) a run starts from: None for a new run
    (checkpoint.resume).

    Rank 0 lists the checkpoints, newest first, and every rank gets its list. Each rank then
    verifies its share of the newest (runtime/verify_share.py): its byte ranges of the files
    the ranks wrote by range, its own DeepSpeed partitions, its part of the rest, about 1/W of
    the checkpoint; one sum of the failures follows. A checkpoint that fails on any rank is
    skipped by all, which try the one before together. Verifying on one rank would make the
    others wait while it reads the whole checkpoint, every ZeRO shard, from shared storage.
    A rank that cannot read the manifest rank 0 read does not see the same run_dir: all
    ranks stop, saying so."""
    if env is None or not env.distributed:
        return _choose(root, resume)
    names = env.decide(lambda: _candidates(root, resume))
    for name in names:
        ckpt = root / name
        problem, unreadable = _verify_my_share(ckpt, env)
        failed, elsewhere, on_main = env.sum(
            [
                float(problem is not None),
                float(unreadable and not env.is_main),
                float(unreadable and env.is_main),
            ]
        )
        if elsewhere and not on_main:  # rank 0 read the manifest that another rank cannot
            _stop_unshared(env, name, problem)
        if not failed:
            return ckpt
        # Only when some rank failed: which, and why (on rank 0, for its log).
        problems = env.gather_to_main(problem)
        if env.is_main:
            found = [(r, p) for r, p in enumerate(problems) if p is not None]
            log.warning(
                "skipping checkpoint %s: %d rank(s) found it damaged (rank %d: %s)",
                name,
                len(found),
                *found[0],
            )
    if names:
        raise CheckpointError(
            f"{root} holds checkpoints but none is valid; move them away to start over"
        )
    return None


def _candidates(root: Path, resume: str) -> list[str]:
    """Rank 0's list of the checkpoints to try, newest first."""
    try:
        existing = checkpoints_in(root)
    except OSError as exc:  # storage rank 0 cannot read: every rank stops with its message
        raise CheckpointError(str(exc)) from None
    if resume == "never":
        _refuse_existing(root, existing)
        return []
    return [c.name for c in reversed(existing)]


def _verify_my_share(ckpt: Path, env: DistEnv) -> tuple[str | None, bool]:
    """(the problem this rank found in its share of `ckpt`, or None; whether it could not read
    the manifest: where rank 0 could, a run_dir that is not the same storage on every rank)."""
    try:
        text = (ckpt / MANIFEST_FILE).read_text()
    except OSError as exc:
        return f"{ckpt} has no readable {MANIFEST_FILE} ({exc})", True
    try:  # what rank 0 reads too: damage, the same on every rank, never a hang
        files = json.loads(text)["files"]
        return verify_share(ckpt, files, env.rank, env.world_size, shard_rank), False
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{ckpt}: {type(exc).__name__}: {exc}", False


def _stop_unshared(env: DistEnv, name: str, problem: str | None) -> None:
    problems = [(rank, p) for rank, p in enumerate(env.gather(problem)) if p is not None]
    rank, what = problems[0]
    raise CheckpointError(
        f"rank 0 listed {name} to resume from, but {len(problems)} rank(s) cannot "
        f"read it (rank {rank}: {what}). Every rank must see the same run_dir: put it "
        "on storage all nodes share"
    )


def _choose(root: Path, resume: str) -> Path | None:
    existing = checkpoints_in(root)
    if resume == "never":
        _refuse_existing(root, existing)
        return None
    latest = latest_valid(root)
    if existing and latest is None:
        raise CheckpointError(
            f"{root} holds checkpoints but none is valid; move them away to start over"
        )
    return latest


def _refuse_existing(root: Path, existing: list[Path]) -> None:
    if existing:
        raise CheckpointError(
            f"{root.parent} already holds checkpoints ({existing[-1].name}) and "
            "checkpoint.resume=never: choose a new run_dir, or delete the old run first"
        )


def load_state(run: Any, ckpt: Path, startup: StartupTimes) -> dict[str, Any]:
    """Every rank loads `ckpt` (found by `resume_point`, which verified its checksums) into
    `run` (a manager.Tracked): weights, engine state and the data position, timed apart in
    `startup`. Returns the trainer state, for its counters and RNG states."""
    with startup.phase("checkpoint load"):
        # The engine's tensors (Adam's moments) stay unread until it is known whether they
        # are loaded whole or resharded, when each rank reads only its part.
        trainer_state, manifest = load_checkpoint(
            ckpt,
            None,
            expect_model=run.cfg.model,
            tokenizer=run.tok,
            verify=False,
            lazy=lambda key: key.startswith("/engine/"),
            files=_checked,
        )
        _load_engine(run, ckpt, trainer_state, manifest)
        _load_ema(run.engine, ckpt, manifest)
        _warn_of_another_batch(run.cfg.train, run.env.world_size, manifest)
    with startup.phase("data position"):
        caches = getattr(run.loader.rows, "caches", [])  # a stream has none
        data = compat.data_state(trainer_state["data"], caches)
        run.loader.load_state_dict(data)  # the position of all ranks
    return trainer_state


def _checked(name: str) -> bool:
    """No file's size is checked again: resume_point checked this rank's."""
    return False


def _load_engine(run: Any, ckpt: Path, trainer_state: dict, manifest: dict) -> None:
    """Weights and engine state: in the engine's own format when the topology is
    unchanged (bitwise), else resharded by parameter name."""
    cfg, env, engine = run.cfg, run.env, run.engine
    saved = reshard.topology_of(manifest, trainer_state)
    here = topology(cfg, env.world_size)
    if saved.same_layout(here):  # the engine reads its own format: a bitwise resume
        if engine.loads_weights:
            load_checkpoint(
                ckpt, engine.module, verify=False, with_trainer_state=False, files=_checked
            )
        engine.load_state_dict(read_stored(trainer_state["engine"], ckpt), ckpt)
    else:  # weights and optimizer state resharded by parameter name
        log.warning("checkpoint written by %s, resuming on %s: resharding its state", saved, here)
        with reshard.read(ckpt, trainer_state, saved, whole_shapes(engine.module)) as state:
            engine.load_portable(state)
        # Each rank read its share of the state, not the whole of it (ZeRO): say so.
        busiest = env.max([float(state.bytes_read)])[0] if env.distributed else state.bytes_read
        log.info(
            "resharding read %s of the checkpoint's %s of weights and optimizer state on the "
            "busiest rank",
            size_text(busiest),
            size_text(state.bytes_stored),
        )


def _load_ema(engine: Any, ckpt: Path, manifest: dict) -> None:
    """train.ema: this rank's share of the checkpoint's ema.safetensors (under ZeRO-3 its
    partition of each parameter, read by element range), on any topology: the file holds
    whole tensors by name, as model.safetensors does. A checkpoint saved without one (train.ema
    turned on at this resume) leaves the EMA to start from the weights resumed."""
    if engine.ema is None:
        return
    if EMA_FILE not in manifest["files"]:
        log.warning(
            "%s holds no moving average of the weights (it was saved without train.ema): "
            "the EMA starts from the weights resumed",
            ckpt,
        )
        return
    with safe_open(str(ckpt / EMA_FILE), framework="pt") as fh:
        engine.ema.load(
            lambda key, start, end: reshard.Rows(fh, key).read(start, end), fh.metadata() or {}
        )


def _warn_of_another_batch(train: Any, world_size: int, manifest: dict) -> None:
    """A resume whose step takes another number of tokens than the checkpoint's did (with
    train.grad_accum on another world size, or a changed batch setting) keeps the schedule's
    step count, which then means another thing: say so, and how to keep the batch."""
    saved = manifest["config"].get("train", {})
    saved_world = manifest.get("world_size")
    if saved_world is None:  # written before the manifest held it
        return
    before = saved.get("tokens_per_step") or (
        saved.get("max_tokens", 0) * (saved.get("grad_accum") or 1) * saved_world
    )
    now = train.step_tokens(world_size)
    if before != now:
        log.warning(
            "the checkpoint's steps took %s tokens over %d rank(s), this run's take %s over %d: "
            "the schedule's warmup and rates now apply to another batch. To keep one batch on "
            "any number of GPUs, set train.tokens_per_step=%d (and train.grad_accum=null)",
            f"{before:,}",
            saved_world,
            f"{now:,}",
            world_size,
            before,
        )


def restore_rng(run: Any, ckpt: Path, trainer_state: dict, step: int) -> None:
    """This rank's dropout stream from the checkpoint's RNG states: its own, read from
    rng.safetensors (checkpoint/rng_file.py; an older form: checkpoint/compat.py); on another
    world size, fresh distinct streams derived from the step resumed at."""
    env = run.env
    older = compat.rng_in_trainer_state(trainer_state, env.rank)
    saved, mine = older if older is not None else rng_file.read_own(ckpt, env.rank)
    if saved == env.world_size and mine is not None:
        load_rng_state(mine)
    else:  # another world size: fresh, distinct streams, derived from the step
        log.warning(
            "checkpoint has RNG states of %d ranks, this run has %d: dropout reseeded",
            saved,
            env.world_size,
        )
        seed_everything(run.cfg.train.seed + 1_000_003 * env.rank + step)
