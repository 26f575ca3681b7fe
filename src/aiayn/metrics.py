"""Console, log file and TensorBoard. Rank 0 writes; other ranks stay quiet."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("aiayn")


def setup_logging(run_dir: str | Path | None, rank: int = 0) -> None:
    """Plain lines on stderr and, on rank 0, in run_dir/train.log. Other ranks: warnings only."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    root.addHandler(console)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if run_dir is not None and rank == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(Path(run_dir) / "train.log")
        file.setFormatter(fmt)
        root.addHandler(file)


class Metrics:
    """Scalars to the console and TensorBoard (`run_dir/tb`), written by rank 0 only."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.writer = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tb"))

    def log(self, split: str, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        text = " ".join(f"{k} {_fmt(v)}" for k, v in scalars.items())
        log.info("%s step %d | %s", split, step, text)
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(f"{split}/{key}", value, step)

    def text(self, tag: str, step: int, text: str) -> None:
        if self.enabled and self.writer is not None:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
