"""What a training run reports as it goes: each log line's window of statistics (loss,
accuracy, tokens/s, MFU against the device's peak, memory), the start-up line, what the data
loader read and dropped, the checksums read at a start, and the ids of each step's examples.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aiayn.data import Loader
from aiayn.distributed.env import DistEnv
from aiayn.errors import TrainingError
from aiayn.runtime.durable import bytes_hashed
from aiayn.train.flops import raise_kept_peak
from aiayn.train.monitor import cuda_memory, memory_bytes
from aiayn.train.run import Run

log = logging.getLogger("aiayn")


@dataclass
class Window:
    """Statistics between two log lines. Loss and accuracy stay on the device (no host sync
    per step); timings and FLOPs are host-side arithmetic."""

    loss: torch.Tensor | float = 0.0
    correct: torch.Tensor | float = 0.0
    tokens: int = 0
    steps: int = 0
    flops: int = 0
    data_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, tokens: int) -> None:
        self.loss = self.loss + loss.detach().float()
        self.correct = self.correct + correct
        self.tokens += tokens


def log_checksums(env: DistEnv) -> None:
    """What checksums read at this start, summed over the ranks, and on the busiest rank:
    verifying the checkpoint and the token cache, about one of each over all the ranks, each
    rank its share; at a first start also the corpus a cache build read, each file or range
    hashed by the rank that read it, and the arrays rank 0 wrote."""
    hashed = bytes_hashed()
    total, ranks = env.sum([float(hashed), float(hashed > 0)])
    busiest = env.max([float(hashed)])[0]
    if total:
        log.info(
            "checksums at start: %s bytes hashed by %d of %d rank(s), at most %s by one",
            f"{int(total):,}",
            ranks,
            env.world_size,
            f"{int(busiest):,}",
        )


def log_startup(run: Run, first_batch_wait: float) -> None:
    """The start-up line, once this process's first step is over: on a restart, the time a
    fault cost from this process's creation on (aiayn/runtime/startup.py)."""
    if run.env.device.type == "cuda":
        torch.cuda.synchronize(run.env.device)  # once: the first step has run, not only queued
    line, split = run.startup.first_step_done(first_batch_wait)
    log.info("%s", line)
    names = {name: "startup_s/" + name.replace(" ", "_").replace("/", "_") for name in split}
    run.metrics.scalars({names[k]: v for k, v in split.items()}, run.progress.step)


def record_ids(run: Run, fetched: list) -> None:
    path = Path(run.cfg.run_dir) / "consumed" / f"rank_{run.env.rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for taken in fetched:
            batch = taken.batch
            row = {"step": run.progress.step + 1, "epoch": taken.epoch, "ids": batch.ids.tolist()}
            if batch.sources is not None:  # a mixture: ids count within each source
                row["sources"] = batch.sources.tolist()
            fh.write(json.dumps(row) + "\n")


def log_data(loader: Loader, when: str) -> None:
    """What the loader read and dropped, so a filtered corpus never goes unnoticed."""
    stats = loader.stats()
    log.info("%s | data: %s", when, ", ".join(f"{k} {v}" for k, v in stats.items()))
    dropped = stats["dropped_too_long"] + stats["dropped_empty"] + stats["invalid_utf8_skipped"]
    if dropped > 0.05 * max(stats["examples_read"], 1):
        log.warning(
            "%d of %d examples were dropped: see data.max_len and the corpus",
            dropped,
            stats["examples_read"],
        )


def log_window(run: Run, window: Window, grad_norm, console: bool) -> dict[str, float]:
    """One host sync per log line: the window's sums come off the device together."""
    step, progress = run.progress.step, run.progress
    loss_sum, correct, tokens, flops = run.env.sum(
        [float(window.loss), float(window.correct), window.tokens, window.flops]
    )
    if not math.isfinite(loss_sum):
        raise TrainingError(
            f"the training loss became {loss_sum} before step {step}. No checkpoint holds these "
            "weights. Lower the learning rate (schedule.factor), set train.clip_norm (e.g. 1.0), "
            "or use train.precision=fp32, then re-run: it resumes from the last good checkpoint."
        )
    elapsed = max(time.perf_counter() - window.started, 1e-9)
    loss = loss_sum / max(tokens, 1)
    scalars = {
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
        "accuracy": correct / max(tokens, 1),
        "lr": run.engine.lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": tokens / elapsed,  # all ranks
        "step_time_s": elapsed / max(window.steps, 1),
        "data_wait_fraction": window.data_seconds / elapsed,  # rank 0's
        "mfu": flops / elapsed / (mfu_peak(run, flops / elapsed) * run.env.world_size),
        "memory_gib": memory_bytes(run.env.device) / 2**30,
        **cuda_memory(run.env.device),
        "loss_scale": run.engine.loss_scale,
        "skipped_steps": run.engine.skipped_steps,
        "tokens": progress.tokens,
    }
    run.metrics.log("train", step, scalars, console=console)
    mixture = run.loader.mixture_scalars()  # what the group took of each source: {} for one
    if mixture:
        run.metrics.log("data", step, mixture, console=False)
    return {k: scalars[k] for k in ("loss", "lr", "tokens_per_s")}


def mfu_peak(run: Run, achieved: float) -> float:
    """The peak MFU counts against. A measured one (CPU) was taken once, at the run's first
    start, maybe under load; when training outruns it, it was too low, and the rate training
    reached is the better estimate from then on (kept for restarts): so MFU never exceeds 1."""
    per_rank = achieved / run.env.world_size
    if run.peak_measured and per_rank > run.peak_flops:
        log.warning(
            "training reached %.3g TFLOP/s per rank, above the %.3g TFLOP/s measured as this "
            "device's peak at the run's first start (measured under load?): MFU counts against "
            "the rate reached from here on",
            per_rank / 1e12,
            run.peak_flops / 1e12,
        )
        run.peak_flops = per_rank
        if run.env.is_main:
            raise_kept_peak(Path(run.cfg.run_dir) / "peak_flops.json", per_rank)
    return run.peak_flops
