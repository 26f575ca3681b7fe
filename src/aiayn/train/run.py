"""One training run's assembled pieces, as train/assemble.py builds them and the loop, the
reports and the checkpoint calls use them."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiayn.checkpoint import CheckpointManager, Progress
from aiayn.config import Config
from aiayn.data import Loader
from aiayn.distributed.env import DistEnv
from aiayn.distributed.preemption import StopFlag, StopVote
from aiayn.engine import Engine
from aiayn.runtime.startup import StartupTimes
from aiayn.tokenizer import Tokenizer
from aiayn.train.monitor import Metrics


@dataclass
class Run:
    """The assembled pieces of one training run."""

    cfg: Config
    env: DistEnv
    tok: Tokenizer
    engine: Engine
    loader: Loader
    ckpts: CheckpointManager
    metrics: Metrics
    progress: Progress
    peak_flops: float
    peak_measured: bool  # a matmul measured at the first start, not a data sheet's or configured
    stop: StopFlag
    startup: StartupTimes
    init: dict | None = None  # init.source's provenance (train/init_source.py)
    vote: StopVote = field(init=False)

    def __post_init__(self) -> None:
        self.vote = StopVote(self.env, self.stop)
