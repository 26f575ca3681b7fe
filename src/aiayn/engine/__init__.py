"""Engines: what steps the model. One process, DDP and DeepSpeed ZeRO behind one interface
(interface.py), with what they share below them: the optimizer and schedule (optim.py,
schedule.py), precision, compile and activation checkpointing (precision.py, parallelize.py),
the replica check, the moving average of the weights (ema.py, train.ema), DeepSpeed's
generated config and op builds, and the state types a
checkpoint reads and writes (state.py). Model code never imports this package; the
checkpoint package sits above it."""

from aiayn.engine.interface import Engine, build_engine

__all__ = ["Engine", "build_engine"]
