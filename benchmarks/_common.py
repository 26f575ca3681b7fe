"""What the benchmark scripts share: the aiayn training step, timing statistics, tables.

Each script is one command that prints a markdown table. Timings on a shared CPU are noisy, so
contenders are interleaved (each repeat runs all of them once, in rotated order) and compared
as medians of repeats taken in the same run, with min and max beside them.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Run from a checkout without installing: `python benchmarks/throughput.py`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from aiayn.config import Config, config_from_dict  # noqa: E402
from aiayn.data.batch import Batch  # noqa: E402
from aiayn.distributed.env import DistEnv  # noqa: E402
from aiayn.engine.loss import batch_loss  # noqa: E402
from aiayn.engine.registry import build_engine  # noqa: E402
from aiayn.model import build_model  # noqa: E402
from aiayn.tokenizer import PAD_ID as PAD  # noqa: E402


def run_config(preset: str, data: dict | None = None, **train) -> Config:
    """A seq2seq run config of a model preset, validated like a YAML file would be."""
    data = data or {"train": "unused: batches are made by the benchmark"}
    return config_from_dict({"model": {"preset": preset}, "data": data, "train": train})


class AiaynTrainer:
    """The project's own training step: model, label-smoothed loss and LocalEngine (Adam,
    gradient norm, the warmup schedule), as train.py's _train_step runs it."""

    name = "aiayn"

    def __init__(self, cfg: Config, vocab_size: int, name: str | None = None, device: str = "cpu"):
        torch.manual_seed(cfg.train.seed)
        self.cfg = cfg
        model = build_model(cfg.model, vocab_size, PAD)
        self.engine = build_engine(model, cfg, DistEnv(0, 1, torch.device(device)))
        self.name = name or self.name

    def step(self, batch: Batch) -> None:
        self.engine.train()
        with self.engine.autocast():
            loss, _ = batch_loss(
                self.engine.model, batch, "seq2seq", self.cfg.train.label_smoothing, PAD
            )
        self.engine.backward(loss / batch.n_tokens)
        self.engine.step()


def time_steps(step: Callable[[Batch], None], batches: list[Batch]) -> float:
    """Seconds to train on `batches`, one optimizer step each (CPU: no device sync needed)."""
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    return time.perf_counter() - start


def interleaved(
    contenders: dict[str, Callable[[], float]], repeats: int, between: Callable[[], None] = None
) -> dict[str, list[float]]:
    """Call every contender once per repeat, in an order rotated each repeat, so slow phases of
    a busy machine fall on all of them alike. Returns each one's results."""
    names = list(contenders)
    results: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in rotated(names, r):
            results[n].append(contenders[n]())
        if between is not None:
            between()
    return results


def rotated(names: list[str], k: int) -> list[str]:
    """`names` starting from the k-th (mod their number): the order of one round of calls."""
    k %= len(names)
    return names[k:] + names[:k]


def summary(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def set_threads(threads: int | None) -> int:
    """The intra-op thread count, the same in every contender's process."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def machine() -> str:
    """One line naming the machine, for the results table."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if "model name" in line)
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {load:.2f} at start, "
        f"{time.strftime('%Y-%m-%d')}"
    )


def fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def torchrun(nproc: int) -> list[str]:
    """torchrun for `nproc` processes on this machine, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
    ]
