"""Training: the loop (loop.py), the run's start (assemble.py, init_source.py for init.source),
its dev sets and early stopping, what it reports as it goes (report.py, flops.py for MFU), the
memory probe, and the messages for a failed peer. Above everything else but the command line."""

from aiayn.train.loop import train

__all__ = ["train"]
