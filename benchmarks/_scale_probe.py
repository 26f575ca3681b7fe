"""A rank of `aiayn` that reports what it read, for benchmarks/scale.py.

    torchrun ... benchmarks/_scale_probe.py OUT_DIR train --config ...

Runs `aiayn ARGS...` in this process, counting the bytes it reads from corpus files (every
line-aligned corpus file is opened through aiayn.data.line_files.open_bytes) and how many it
opens, and at exit writes OUT_DIR/rank<RANK>.json: those two, the bytes sha256_of hashed
(verifying checkpoints and caches, writing their manifests), the process's read(2) bytes
(/proc/self/io rchar: imports included), its stat calls on the checkpoints' files (every
os.stat, libraries' included), the opens and listings of them and the bytes it gathered from
other ranks (aiayn.runtime.io_counts), the bytes it wrote while saving a
checkpoint (wchar during CheckpointManager.save), how far its allocated host memory rose during
a save and during a validation (sampled; under ZeRO-3 one layer's weights, never the whole
model), the same two rises in CUDA memory allocated when the run is on a GPU, its peak
resident memory, and its start-up split by phase (aiayn/runtime/startup.py): rank 0 logs it
in train.log, the other ranks log only warnings, so the probe keeps each rank's as it is made.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from aiayn.checkpoint import manager  # noqa: E402
from aiayn.data import line_files  # noqa: E402
from aiayn.eval import validation  # noqa: E402
from aiayn.runtime import durable, io_counts  # noqa: E402
from aiayn.runtime.malloc import AllocatedPeak  # noqa: E402
from aiayn.runtime.startup import StartupTimes  # noqa: E402

counts = {
    "corpus_bytes": 0,
    "corpus_opens": 0,
    "save_written": 0,
    "save_peak_growth": 0,
    "valid_peak_growth": 0,
    "save_cuda_growth": 0,
    "valid_cuda_growth": 0,
    "ckpt_stat_calls": 0,
    "startup_split": None,
}


class _Counted:
    """A binary file whose reads are counted (line iteration and read())."""

    def __init__(self, opened):
        self._opened = opened  # a file, or a context manager giving one (a hashing read)

    def __enter__(self):
        self._fh = self._opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self._opened.__exit__(*exc)

    def __iter__(self):
        for line in self._fh:
            counts["corpus_bytes"] += len(line)
            yield line

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        counts["corpus_bytes"] += len(data)
        return data

    def readline(self) -> bytes:
        line = self._fh.readline()
        counts["corpus_bytes"] += len(line)
        return line

    def seek(self, offset: int) -> int:
        return self._fh.seek(offset)


open_bytes = line_files.open_bytes


def _counting_open(path: str, digest=None):
    counts["corpus_opens"] += 1
    return _Counted(open_bytes(path, digest))


def _io() -> dict[str, int]:
    io = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, value = line.split(":")
            io[key] = int(value)
    except OSError:
        pass
    return io


def _measured(name: str, method, counts_writes: bool = False):
    """`method`, wrapped to record how far this rank's allocated host memory (malloc's bytes
    in use, sampled every millisecond: aiayn.runtime.malloc.AllocatedPeak) and, on a GPU, its CUDA
    memory allocated rose above where they were when the call began, as NAME_peak_growth and
    NAME_cuda_growth (the largest over the run's calls); with counts_writes, also its write(2)
    bytes (a synchronous save's files are all written before it returns; gloo's sockets count
    too). Resident memory is not the measure: freed blocks stay resident and are reused
    (aiayn/runtime/malloc.py), and after a malloc_trim their re-use reads as a rise."""

    def wrapped(self, *args, **kwargs):
        before = _io().get("wchar", 0)
        cuda = torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated()
        try:
            with AllocatedPeak() as host:
                return method(self, *args, **kwargs)
        finally:
            if counts_writes:
                counts[f"{name}_written"] += _io().get("wchar", 0) - before
            counts[f"{name}_peak_growth"] = max(counts[f"{name}_peak_growth"], host.rise or 0)
            if cuda:
                torch.cuda.synchronize()
                rise = torch.cuda.max_memory_allocated() - allocated
                counts[f"{name}_cuda_growth"] = max(counts[f"{name}_cuda_growth"], rise)

    return wrapped


def _keeping_split(method):
    """StartupTimes.first_step_done, keeping the start-up split it returns (every rank's, where
    the log has rank 0's line only)."""

    def wrapped(self, *args, **kwargs):
        line, split = method(self, *args, **kwargs)
        counts["startup_split"] = split
        return line, split

    return wrapped


_stat = os.stat


def _counting_stat(path, *args, **kwargs):
    """os.stat, counting the calls on the checkpoints' files (pathlib's is_file and stat,
    os.path.exists, DeepSpeed's checks): every stat call, where io_counts has the ones aiayn
    makes itself."""
    try:
        name = os.fspath(path)
        if isinstance(name, str) and "/checkpoints/" in os.path.abspath(name) + "/":
            counts["ckpt_stat_calls"] += 1
    except TypeError:  # a file descriptor
        pass
    return _stat(path, *args, **kwargs)


def _report(out: Path, started: float) -> None:
    io = _io()
    report = {
        **counts,
        "hashed_bytes": durable.bytes_hashed(),
        # What it did to the checkpoints' files and gathered from the other ranks in the run
        # (aiayn.runtime.io_counts: stats, opens, listings, gathered_bytes).
        **{f"ckpt_{k}": v for k, v in io_counts.counts().items()},
        "rchar": io.get("rchar"),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": time.perf_counter() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    line_files.open_bytes = _counting_open
    os.stat = _counting_stat
    run_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run_dir="))
    io_counts.watch(Path(run_dir) / "checkpoints")  # opens and listings from the start
    manager.CheckpointManager.save = _measured("save", manager.CheckpointManager.save, True)
    validation.Validation.run = _measured("valid", validation.Validation.run)
    StartupTimes.first_step_done = _keeping_split(StartupTimes.first_step_done)
    atexit.register(_report, out, time.perf_counter())
    sys.argv = ["aiayn", *sys.argv[2:]]
    runpy.run_module("aiayn", run_name="__main__")
