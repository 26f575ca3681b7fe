"""Console, log file, progress bar, TensorBoard and metrics.jsonl. Rank 0 writes; other ranks
stay quiet."""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from aiayn.errors import AiaynError
from aiayn.train.metrics_file import NAME as METRICS_FILE
from aiayn.train.metrics_file import MetricsFile

log = logging.getLogger("aiayn")


class _TqdmHandler(logging.StreamHandler):
    """Log lines printed above a live progress bar instead of through it. The periodic training
    lines the bar already shows go to train.log only."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        if not getattr(record, "file_only", False):
            tqdm.write(self.format(record), file=sys.stderr)


def use_progress_bar() -> bool:
    """A bar for a person at a terminal; plain periodic lines for Slurm logs and pipes."""
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


LOG_TIME = "%Y-%m-%dT%H:%M:%S"  # local time, to the second


def setup_logging(run_dir: str | Path | None, rank: int = 0) -> None:
    """Lines on stderr and, on rank 0, in run_dir/train.log. Other ranks: warnings and errors,
    prefixed with their rank."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    prefix = "" if rank == 0 else f"[rank {rank}] "
    # ISO dates: a log read days later, or beside a scheduler's, says when each line was.
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", LOG_TIME)
    console = _TqdmHandler() if rank == 0 and use_progress_bar() else logging.StreamHandler()
    console.setFormatter(fmt)
    root.addHandler(console)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if run_dir is not None and rank == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(Path(run_dir) / "train.log")
        file.setFormatter(fmt)
        root.addHandler(file)
    # Libraries' chatter (TensorBoard's directory watcher, datasets) is not our log.
    for name in ("tensorboard", "datasets", "fsspec", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def log_fatal(exc: BaseException) -> None:
    """An error that stops training, written to train.log (rank 0's file handler) with its
    traceback, or its message alone for an error the user can act on. Not to stderr: the
    command prints it there itself (cli/__init__.py), once."""
    user = isinstance(exc, AiaynError)
    message = f"{type(exc).__name__}: {exc}" if not user else str(exc)
    record = logging.LogRecord(
        "aiayn",
        logging.ERROR,
        __file__,
        0,
        "training stopped: %s",
        (message,),
        None if user else (type(exc), exc, exc.__traceback__),
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def memory_bytes(device: torch.device) -> float:
    """Peak CUDA memory allocated on a GPU; the process's resident memory on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as fh:
            return float(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:  # not Linux: the peak, in KiB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)


def cuda_memory(device: torch.device) -> dict[str, float]:
    """On a GPU, what the caching allocator holds beside what tensors use: memory reserved
    now, and how often an allocation found no free block, flushed the cache and retried (each
    retry a synchronising cudaFree; a count that grows means fragmentation). Empty on CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "memory_reserved_gib": stats.get("reserved_bytes.all.current", 0) / 2**30,
        "alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }


class Metrics:
    """Scalars, text and hparams to the console, TensorBoard (`run_dir/tb`) and the scalars to
    `run_dir/metrics.jsonl` (train/metrics_file.py), rank 0 only.

    `resume_step`: the step a run resumes from (0 at a first start). TensorBoard is told to
    drop the events logged past it (`purge_step`), and metrics.jsonl drops its lines past it,
    so after a restart no step appears twice: the resumed run logs them again.
    """

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool, resume_step=0):
        self.enabled = enabled
        self.writer = None
        self.file = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.file = MetricsFile(Path(run_dir) / METRICS_FILE, resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = Path(run_dir) / "tb"
            _wait_for_a_later_second(tb)
            # Also at a first start (purge from step 1): a run killed before its first
            # checkpoint starts over, and what it had logged is dropped, as in metrics.jsonl.
            self.writer = SummaryWriter(str(tb), purge_step=resume_step + 1)

    def log(self, split: str, step: int, scalars: dict[str, float], console: bool = True) -> None:
        if not self.enabled:
            return
        text = " ".join(f"{k} {_fmt(v)}" for k, v in scalars.items())
        log.info("%s step %d | %s", split, step, text, extra={"file_only": not console})
        self.scalars({f"{split}/{key}": value for key, value in scalars.items()}, step)

    def scalars(self, scalars: dict[str, float], step: int) -> None:
        """TensorBoard and metrics.jsonl only, under the tags given: figures a log line
        already shows."""
        if not self.enabled:
            return
        self.file.write(step, scalars)
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, step: int, text: str) -> None:
        if self.enabled and self.writer is not None:
            self.writer.add_text(tag, text, step)

    def hparams(self, config: dict[str, Any], final: dict[str, float], step: int) -> None:
        """The resolved config beside the final metrics (TensorBoard's HParams tab); the
        metrics also in metrics.jsonl, under the tags TensorBoard gives them."""
        if not self.enabled:
            return
        metrics = {f"hparam/{k}": v for k, v in final.items() if isinstance(v, int | float)}
        self.file.write(step, metrics)
        if self.writer is None:
            return
        flat = {
            k: v if isinstance(v, int | float | str | bool) else str(v)
            for k, v in _flatten(config).items()
        }
        self.writer.add_hparams(flat, metrics, run_name=".", global_step=step)

    def flush(self) -> None:
        if self.file is not None:
            self.file.sync()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


class ProgressBar:
    """tqdm on rank 0 at a terminal (loss, lr, tokens/s, ETA); nothing otherwise."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled and use_progress_bar():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, postfix: dict[str, float] | None = None) -> None:
        if self.bar is None:
            return
        if postfix:
            self.bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _wait_for_a_later_second(tb: Path) -> None:
    """TensorBoard reads event files in name order, and names start with the creation second
    then the pid. A run restarted within the second its predecessor started could sort first
    and have its purge applied before the old events load; waiting (under a second, once)
    keeps name order chronological."""
    stamps = [int(p.name.split(".")[3]) for p in tb.glob("events.out.tfevents.*")]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = "null" if value is None else value
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
