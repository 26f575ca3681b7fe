"""A collective that failed because another rank died or stalled: told apart from this rank's
own errors, and reported with what to do (which rank to look at, the checkpoint a restart takes).
"""

from __future__ import annotations

import torch

from aiayn.errors import PeerError
from aiayn.train.run import Run


def is_collective_failure(exc: RuntimeError) -> bool:
    """gloo raises a plain RuntimeError naming itself, or its pair ("Application timeout caused
    pair closure", what an operation that timed out reports when it was waited for later);
    NCCL's errors are DistErrors."""
    text = str(exc)
    return isinstance(exc, torch.distributed.DistError) or "gloo" in text or "pair closure" in text


def peer_error(run: Run, exc: RuntimeError) -> PeerError:
    step, dist = run.progress.step + 1, run.cfg.distributed
    name = "timeout_minutes" if run.startup.done else "first_step_timeout_minutes"
    minutes = getattr(dist, name)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    if "timeout" in first_line.lower() and "timed out" not in first_line.lower():
        first_line = f"timed out: {first_line}"
    latest = run.ckpts.named_latest() or "none (a new run)"
    return PeerError(
        f"step {step}: a collective failed on rank {run.env.rank} ({first_line}). Another "
        f"rank died, or stalled for distributed.{name} ({minutes:g} min); its log "
        f"says why. The latest checkpoint is {latest}: under "
        "`python -m aiayn.distributed.run --max-restarts=N` the group restarts from it."
    )
