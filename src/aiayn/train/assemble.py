"""A training run's start: the pieces built in the order a resume needs them. Process group, the
run directory's lock (before anything is written there) and run-wide settings, the checkpoint
to resume (checked before any work, since it may refuse the config), init.source's starting
point, tokenizer and data, the model and its engine, the loader, then what the checkpoint
restores, the memory probe, the metrics and the start-up line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import ExitStack
from pathlib import Path

import torch

from aiayn.checkpoint import CheckpointManager, Progress
from aiayn.checkpoint.init_from import load_moments
from aiayn.config import Config
from aiayn.data import make_loader
from aiayn.data.batch import resolve_pad_to_multiple
from aiayn.data.hub_revision import pin_hub_revision
from aiayn.data.prepare import prepare_data, warn_serial_start
from aiayn.distributed import faults
from aiayn.distributed.env import DistEnv, setup, use_timeout
from aiayn.distributed.preemption import StopFlag
from aiayn.distributed.run_lock import hold_run_dir
from aiayn.engine import Engine, build_engine
from aiayn.engine import registry as engines
from aiayn.engine.precision import resolve_precision
from aiayn.model import build_model, count_parameters, selection
from aiayn.runtime.malloc import keep_freed_memory
from aiayn.runtime.seeding import seed_everything
from aiayn.runtime.startup import StartupTimes
from aiayn.runtime.torch_settings import configure
from aiayn.tokenizer import Tokenizer
from aiayn.train import memory_probe
from aiayn.train.flops import datasheet_peak, device_peak_flops
from aiayn.train.init_source import Start, load_source, starting_point
from aiayn.train.monitor import Metrics, setup_logging
from aiayn.train.report import log_checksums
from aiayn.train.run import Run

log = logging.getLogger("aiayn")


def assemble(
    cfg: Config,
    stop: StopFlag,
    held: ExitStack,
    startup: StartupTimes,
    explicit: frozenset[str] | None = None,
) -> Run:
    """Every rank builds its run; the collectives inside happen in the same order on all.
    `held` keeps what the run holds until it ends: rank 0's lock on run_dir, released after a
    checkpoint write still in flight."""
    with startup.phase("process group"):
        env = setup(cfg.train.device, cfg.distributed.setup_timeout_minutes)
    run_dir = Path(cfg.run_dir)
    lock = held.enter_context(hold_run_dir(run_dir, env))  # may refuse: one job per run_dir
    setup_logging(run_dir, env.rank)
    for level, note in lock.notes if lock is not None else []:  # a takeover, or no flock
        log.log(level, "%s", note)
    cfg = _settled(cfg, env)
    ckpts = CheckpointManager.from_config(run_dir, cfg.checkpoint, env.is_main)
    held.callback(ckpts.join_writes)  # on the way out, before the lock goes
    with startup.phase("checkpoint verify"):
        resume_from = ckpts.resume_point(cfg.checkpoint.resume, env)  # before any work: may refuse
    start = None
    if cfg.init.source is not None:
        cfg, start = starting_point(cfg, explicit, resume_from, env)
    with startup.phase("tokenizer/data"):
        if env.is_main:  # at scale, a start that prepares its own data says how not to
            warn_serial_start(cfg, env.world_size)
        tok, cache = prepare_data(cfg, env)
    engine, n_params = _model_and_engine(cfg, tok, env, start, resume_from, startup)
    seed_everything(cfg.train.seed + 1_000_003 * env.rank)  # different dropout on each rank
    with startup.phase("tokenizer/data"):
        loader = make_loader(
            cfg,
            cfg.data.train,
            tok,
            train=True,
            rank=env.rank,
            world_size=env.world_size,
            cache=cache,
            pin_memory=env.device.type == "cuda",
            local_rank=env.local_rank,
            local_world_size=env.local_world_size,
        )
    ckpts.track(cfg, tok, engine, loader, env, start and start.provenance)
    progress = ckpts.restore(resume_from, startup) if resume_from is not None else Progress()
    log_checksums(env)
    if memory_probe.wanted(cfg.train.memory_probe, env.device, engine.partitioned):
        kind, smoothing = cfg.model.kind, cfg.train.label_smoothing
        with startup.phase("memory probe"):
            memory_probe.probe(
                engine, loader.largest_batches(), kind, smoothing, tok.pad_id, env.device
            )
    if env.is_main:  # after the checks a resume makes: a refused config never replaces it
        cfg.save(run_dir / "config.yaml")
    # What an interrupted run logged after its last checkpoint is dropped from the curves.
    metrics = Metrics(run_dir, env.is_main, cfg.logging.tensorboard, resume_step=progress.step)
    peak = device_peak_flops(
        env.device,
        cfg.train.precision,
        cfg.logging.peak_tflops,
        tf32=cfg.train.tf32,
        kept=run_dir / "peak_flops.json",
        keep=env.is_main,
    )
    _log_start(cfg, env, tok, n_params, peak, resume_from, progress)
    use_timeout(cfg.distributed.first_step_timeout_minutes, env)  # set-up is done
    startup.set_up_done()
    measured = not cfg.logging.peak_tflops and (
        datasheet_peak(env.device, cfg.train.precision, cfg.train.tf32) is None
    )
    init = start and start.provenance
    return Run(
        cfg, env, tok, engine, loader, ckpts, metrics, progress, peak, measured, stop, startup, init
    )


def _settled(cfg: Config, env: DistEnv) -> Config:
    """The config with what it leaves to the run decided, and the process set up for it."""
    cfg = _resolved(cfg, env.device)
    engines.check(cfg)  # the engine's own settings, before any work
    cfg.train.accumulation(env.world_size)  # refuses a world size that cannot share the batch
    cfg = pin_hub_revision(cfg, env.decide)  # before any record is read
    configure(env.device, cfg.train.tf32, cfg.train.deterministic, cfg.train.attention_kernel)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if env.device.type == "cpu" and cfg.train.malloc == "keep":
        keep_freed_memory()
    return cfg


def _resolved(cfg: Config, device: torch.device) -> Config:
    """`cfg` with what it leaves to the run decided, so that config.yaml and the checkpoints
    record what the run used: the precision (auto), pad_to_multiple (None) and the cooldown in
    steps (a fraction of train.max_steps)."""
    precision = resolve_precision(cfg.train.precision, device)
    multiple = resolve_pad_to_multiple(cfg.data.pad_to_multiple, device)
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, precision=precision),
        data=dataclasses.replace(cfg.data, pad_to_multiple=multiple),
        schedule=cfg.schedule.in_steps(cfg.train.max_steps),
    )


def _model_and_engine(
    cfg: Config,
    tok: Tokenizer,
    env: DistEnv,
    start: Start | None,
    resume_from: Path | None,
    startup: StartupTimes,
) -> tuple[Engine, int]:
    """The model, the same on every rank, with init.source's weights on a first start, wrapped
    by its engine; and its parameter count."""
    with startup.phase("model build"):
        seed_everything(cfg.train.seed)  # the same initial parameters on every rank
        model = build_model(cfg.model, tok.vocab_size, tok.pad_id)
        if start is not None and resume_from is None:  # before the engine wraps it
            load_source(model, start, cfg, tok, env)
        frozen = selection.freeze(model, cfg.train.freeze)  # before the optimizer is made
        if frozen and env.is_main:
            log.info("train.freeze: %s values not trained", f"{frozen:,}")
        n_params = count_parameters(model)  # before ZeRO-3 partitions them
        engine = build_engine(
            model, cfg, env, rebuild=lambda: build_model(cfg.model, tok.vocab_size, tok.pad_id)
        )
    if start is not None and resume_from is None and cfg.init.optimizer == "keep":
        with startup.phase("checkpoint load"):
            load_moments(engine, start.found, cfg)
        start.provenance["reset"] = [r for r in start.provenance["reset"] if r != "optimizer"]
    return engine, n_params


def _log_start(
    cfg: Config,
    env: DistEnv,
    tok: Tokenizer,
    n_params: int,
    peak: float,
    resume_from: Path | None,
    progress: Progress,
) -> None:
    train, world = cfg.train, env.world_size
    log.info(
        "%s model, %s parameters, vocab %d | %s tokens a step over all ranks = %s (%s) "
        "| %s, %s on %s | peak %.3g "
        "TFLOP/s | %s schedule, warmup %d, cooldown %d of %d steps | %s",
        cfg.model.kind,
        f"{n_params:,}",
        tok.vocab_size,
        f"{train.step_tokens(world):,}",
        train.batch(world),
        "train.tokens_per_step" if train.tokens_per_step else "train.grad_accum: grows with ranks",
        engines.topology(cfg, world),
        cfg.train.precision,
        env.device,
        peak / 1e12,
        cfg.schedule.kind,
        cfg.schedule.warmup,
        cfg.schedule.cooldown,
        cfg.train.max_steps,
        f"resumed from {resume_from} (step {progress.step})" if resume_from else "new run",
    )
    if "SLURM_JOB_ID" in os.environ:  # a requeued job starts again under the same id
        log.info(
            "Slurm job %s, restart %s",
            os.environ["SLURM_JOB_ID"],
            os.environ.get("SLURM_RESTART_COUNT", "0"),
        )
    if env.is_main:
        _log_launcher()


def _log_launcher() -> None:
    """Which start of the group this is under torchrun, and a warning where plain torchrun's
    restarts would also restart a preempted run, or an error to fix (distributed/run.py)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]
    launcher = os.environ.get(faults.LAUNCHER_ENV, "torchrun")
    log.info("%s: restart %s on this node (at most %d)", launcher, count, restarts)
    if restarts and launcher == "torchrun":
        log.warning(
            "torchrun --max-restarts=%d restarts a preempted run in place, and an error to fix "
            "%d times: launch with `python -m aiayn.distributed.run` (same options), which "
            "restarts faults only (docs/distributed.md)",
            restarts,
            restarts,
        )
