"""Training: the loop, as the paper's training procedure reads (§5). Each step takes the step's
micro-batches on every rank (about train.tokens of targets in all), runs forward and backward on
each, and lets the engine take one optimizer and schedule step; then the step is logged,
validated and checkpointed when due. Building the run is train/assemble.py's.

text -> tokenizer -> batches -> model -> loss -> engine (backward, clip, optimizer, schedule)
-> checkpoint manager and metrics.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import ExitStack

import torch

from aiayn.config import Config
from aiayn.data import StepBatches
from aiayn.distributed.env import teardown, use_timeout
from aiayn.distributed.parent_death import launcher_gone
from aiayn.distributed.preemption import REQUEUE_EXIT_CODE, Preempted, StopFlag
from aiayn.engine.loss import batch_loss
from aiayn.errors import PeerError, TrainingError
from aiayn.eval.finish import finish
from aiayn.runtime.startup import StartupTimes
from aiayn.train.assemble import assemble
from aiayn.train.dev_sets import DevSets
from aiayn.train.early_stop import EarlyStopping
from aiayn.train.flops import training_flops
from aiayn.train.monitor import ProgressBar, log_fatal
from aiayn.train.peers import is_collective_failure, peer_error
from aiayn.train.report import Window, log_data, log_startup, log_window, record_ids
from aiayn.train.run import Run

log = logging.getLogger("aiayn")


def train(cfg: Config, explicit: frozenset[str] | None = None) -> dict[str, float]:
    """Train until train.max_steps (or train.max_epochs); return the last validation metrics.
    `explicit`: the keys the config file and overrides set (config.keys_set), which
    init.source's model does not override; None: the values other than the defaults."""
    startup = StartupTimes.of_this_process()
    try:
        with StopFlag() as stop, ExitStack() as held:
            run = assemble(cfg, stop, held, startup, explicit)
            try:
                return _loop(run)
            finally:
                run.metrics.close()
    except Preempted:
        raise  # a stop asked for, its checkpoint saved and logged: not a failure
    except BaseException as exc:
        if not isinstance(exc, PeerError):  # _loop logged it, with what the peers said
            log_fatal(exc)  # train.log says why the run stopped, not only the terminal
        raise
    finally:
        teardown()


def _loop(run: Run) -> dict[str, float]:
    cfg = run.cfg
    with StepBatches(run.loader, cfg.train.max_epochs) as steps:
        try:
            return _train_until_done(run, steps)
        except RuntimeError as exc:
            if run.env.distributed and is_collective_failure(exc):
                error = peer_error(run, exc)
                log.error("%s", error)
                raise error from exc
            exc.add_note(f"aiayn: raised on rank {run.env.rank} after step {run.progress.step}")
            raise


def _train_until_done(run: Run, steps: StepBatches) -> dict[str, float]:
    cfg, loader, progress = run.cfg, run.loader, run.progress
    dev, early = DevSets(cfg, run.tok, run.env), EarlyStopping(cfg)
    bar = ProgressBar(cfg.train.max_steps, progress.step, run.env.is_main)
    window, last_eval = Window(), {}
    saved_step, epoch = progress.step, loader.epoch
    while progress.step < cfg.train.max_steps:
        waited = time.perf_counter()
        fetched = steps.next()
        micro = [taken.batch for taken in fetched]
        window.data_seconds += time.perf_counter() - waited
        if fetched[-1].epoch != epoch:
            log_data(loader, f"epoch {epoch} done")
            epoch = fetched[-1].epoch
        # Every rank knows the step's targets on all ranks and their epochs from the rounds
        # (data/loader.py): no collective; the stop request is agreed without waiting.
        n_tokens, past_limit = steps.group_totals()
        stop_now = run.vote.agreed()
        if past_limit:  # stop together when any rank's step reached the limit (data/steps.py)
            steps.give_back()
            break
        if cfg.logging.record_ids:
            record_ids(run, fetched)
        grad_norm = _train_step(run, micro, window, n_tokens, fetched[-1].round_forwards)
        if not run.startup.done:
            log_startup(run, window.data_seconds)
            use_timeout(cfg.distributed.timeout_minutes, run.env)  # a lost rank fails fast
        step, last = progress.step, progress.step == cfg.train.max_steps
        shown, valid = None, None
        if step % cfg.logging.every_steps == 0 or last:
            shown = log_window(run, window, grad_norm, bar.bar is None)
            window = Window()
        bar.update(shown)
        if stop_now:
            _stop(run, window, step)
        stop_early = False
        if dev.due(step, last):
            valid = dev.validate(run.engine, run.metrics, step)
            if valid is not None:
                last_eval = valid
                stop_early = early.should_stop(progress, valid) and not last
        if run.ckpts.due(step, last=last or stop_early):
            _save(run, window, step, valid)
            saved_step = step
        if stop_early:
            break
        if window.tokens == 0:  # tokens/s measures training, not validation or saving
            window.started = time.perf_counter()
    run.vote.close()  # the stop vote started by the last step
    if progress.step != saved_step:  # stopped early by max_epochs
        _save(run, window, progress.step)
    _finish_run(run, bar, last_eval)
    return last_eval


def _train_step(
    run: Run, micro: list, window: Window, n_tokens: int, forwards: int
) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches, of `n_tokens` targets on all ranks,
    in `forwards` forwards (the most a rank runs this step); returns the gradient norm.
    Nothing here waits for the device (but fp16's loss scaler, in engine.step) or for the
    other ranks: the step's targets on all ranks and its forwards come from the loader's
    rounds (data/loader.py), and what it logs stays on the device until a log line (Window)."""
    cfg, engine = run.cfg, run.engine
    engine.train()
    # Where the world size does not divide the step's units, or a rank fuses its own into
    # fewer forwards, a rank with fewer repeats its last with weight 0: every rank runs the
    # same forwards, and so the same collectives (ZeRO-3 and FSDP2 gather each layer in each
    # forward).
    for i in range(forwards):
        real = i < len(micro)
        batch = micro[min(i, len(micro) - 1)]
        if real:
            window.flops += training_flops(cfg.model, run.tok.vocab_size, batch)
        batch = batch.to(run.env.device)
        with engine.accumulating(last=i == forwards - 1):
            with engine.autocast():
                loss, correct = batch_loss(
                    engine.model, batch, cfg.model.kind, cfg.train.label_smoothing, run.tok.pad_id
                )
            # Dividing by the step's tokens on all ranks, not the micro-batch's, makes
            # accumulation and data parallelism compute the same update as one big batch.
            engine.backward(loss / max(n_tokens, 1) if real else loss * 0)
        if real:
            window.add(loss, correct, batch.n_tokens)
    run.ckpts.before_update()  # an async save may still be copying the weights it changes
    grad_norm = engine.step()
    run.progress.step += 1
    run.progress.tokens += n_tokens
    window.steps += 1
    return grad_norm


def _stop(run: Run, window: Window, step: int) -> None:
    """Preemption: every rank saves this step, then raises Preempted (exit code 75)."""
    _save(run, window, step)
    run.ckpts.wait(run.env)
    waited = time.monotonic() - run.stop.received_at if run.stop.requested else 0.0
    source = f"{waited:.2f}s after the signal" if run.stop.requested else "signal on another rank"
    if (launcher := launcher_gone()) is not None:
        source += f"; this process's launcher (pid {launcher}) has died"
    log.warning(
        "stop requested: saved step %d (%s); exiting with %d: checkpointed, requeue me",
        step,
        source,
        REQUEUE_EXIT_CODE,
    )
    raise Preempted(step, waited)


def _save(run: Run, window: Window, step: int, valid: dict[str, float] | None = None) -> None:
    """Checkpoint `step`, never from weights a non-finite loss has touched (on any rank)."""
    if not math.isfinite(run.env.sum([float(window.loss)])[0]):
        latest = run.ckpts.named_latest()
        raise TrainingError(
            f"non-finite training loss before step {step}; not saving. The last good checkpoint "
            f"is {latest or 'none'}. Lower schedule.factor or set train.clip_norm, then re-run."
        )
    run.ckpts.save_step(step, run.progress, valid)  # a failed save is retried at the next one
    failed = {"failed_saves": len(run.ckpts.failures.steps)}  # in a row, up to max_failed_saves
    run.metrics.log("checkpoint", step, failed, console=False)
    run.metrics.flush()  # the curves up to a checkpoint survive a crash with it


def _finish_run(run: Run, bar: ProgressBar, last_eval: dict[str, float]) -> None:
    """After the last step: the last checkpoint on disk, the run's hyperparameters beside its
    last scores, and with train.finish the averaged model."""
    cfg, progress = run.cfg, run.progress
    run.ckpts.wait(run.env)  # a background write of the last checkpoint
    bar.close()
    log_data(run.loader, f"training done at step {progress.step}, epoch {run.loader.epoch}")
    hparams = cfg.to_dict()
    if run.init:  # the source as given, and where it resolved
        hparams["init"] = {**hparams["init"], **run.init}
    run.metrics.hparams(hparams, {f"valid_{k}": v for k, v in last_eval.items()}, progress.step)
    if cfg.train.finish and run.env.is_main:  # the averaged model: one process's work
        finish(cfg.run_dir, cfg.train.finish, cfg.train.finish_select)
