"""Engines: what steps the model. One process, DDP and DeepSpeed ZeRO behind one interface
(interface.py), found by distributed.backend in registry.py (each engine's kind.py `Kind`),
with what they share below them: the optimizer and schedule (optim.py, schedule.py),
precision, compile and activation checkpointing (precision.py, parallelize.py), the replica
check, the moving average of the weights (ema.py, train.ema), DeepSpeed's generated config,
files and op builds, and the state types a checkpoint reads and writes (state.py). Model code
never imports this package; the checkpoint package sits above it."""

from aiayn.engine.interface import Engine
from aiayn.engine.registry import build_engine

__all__ = ["Engine", "build_engine"]
