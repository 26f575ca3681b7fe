"""Whether the data-parallel replicas of the model still hold the same parameters: nanotron's
sanity check at named points, which every engine that replicates parameters runs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from aiayn.distributed.env import DistEnv


def replicas_differ(module: nn.Module, env: DistEnv) -> bool:
    """True if parameters differ between data-parallel ranks: one all-reduce of per-tensor
    sums, compared as min and max."""
    if not env.distributed:
        return False
    sums = torch.stack([p.detach().double().sum() for p in module.parameters()])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return not torch.equal(low, high)
