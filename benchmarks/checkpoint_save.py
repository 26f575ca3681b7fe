"""How long a checkpoint save blocks training: synchronous vs `checkpoint.async_save`.

    python benchmarks/checkpoint_save.py [--preset transformer_base] [--vocab 37000] [--repeats 3]

Builds the model and its Adam state (one optimizer step), then saves through the checkpoint
manager the trainer uses: synchronously (weights, trainer state, fsync, checksums, rename all
before returning) and asynchronously (training waits for the host copy only; the rest runs in
a background thread). Reports the blocking time (median, min-max) and the background write.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from aiayn.checkpoint import CheckpointManager
from aiayn.config import load_config
from aiayn.distributed.env import DistEnv
from aiayn.engine.registry import build_engine
from aiayn.model import build_model, count_parameters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="transformer_base")
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(None, ["data.train=unused", f"model.preset={args.preset}"])
    torch.manual_seed(0)
    engine = build_engine(
        build_model(cfg.model, args.vocab, 0), cfg, DistEnv(0, 1, torch.device("cpu"))
    )
    src = torch.randint(4, args.vocab, (8, 16))
    engine.model(src, src).float().square().mean().backward()
    engine.step()  # Adam's moments exist from here
    meta = {"config": cfg.to_dict(), "tokenizer": {}}
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    written: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        for step in range(1, args.repeats + 1):
            for mode in ("sync", "async"):
                ckpts = CheckpointManager(
                    f"{root}/{mode}", 1, 2, is_writer=True, async_save=mode == "async"
                )
                state = {"engine": engine.state_dict(), "progress": {"step": step}}
                started = time.perf_counter()
                ckpts.save(step, engine, state, meta)
                blocked[mode].append(time.perf_counter() - started)
                ckpts.wait()
                if mode == "async":
                    written.append(time.perf_counter() - started)
    n = count_parameters(engine.module)

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"

    print(f"\nCheckpoint save, {args.preset} preset, vocab {args.vocab}: {n:,} parameters, ")
    print(f"weights {4 * n / 2**20:.0f} MiB + Adam state {8 * n / 2**20:.0f} MiB, fp32\n")
    print("| save | training blocked, median (min-max) |")
    print("| --- | --- |")
    print(f"| synchronous | {fmt(blocked['sync'])} |")
    print(f"| checkpoint.async_save=true | {fmt(blocked['async'])} |")
    print(f"| (its background write, to the end) | {fmt(written)} |")
    ratio = statistics.median(blocked["sync"]) / statistics.median(blocked["async"])
    print(f"\nasync blocks {ratio:.1f}x less than a synchronous save")
    return 0


if __name__ == "__main__":
    sys.exit(main())
