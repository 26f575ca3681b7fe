"""Run by test_step_collectives.py under torchrun: `aiayn train` in this process, writing to
OUT/rank_<r>.json every collective the trainer calls through torch.distributed (op, group's
backend, tensors' devices) and, per optimizer step, where it began in that list and the host
syncs inside it (tests/syncs.py).

The default group says it is NCCL (dist.get_backend() with no group), as it would on GPUs, so
DistEnv takes the path a GPU job takes; the group itself is gloo, as it must be on a CPU.

usage: step_collectives.py CONFIG OUT [overrides ...]
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for syncs.py

from aiayn.config import load_config  # noqa: E402
from aiayn.train import loop as train_module  # noqa: E402

from syncs import SyncCounter  # noqa: E402

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "reduce_scatter",
    "all_to_all",
)


def main(config: str, out: str, *overrides: str) -> None:
    calls: list[dict] = []
    backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else backend(group)

    def counting(name, real):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            tensors = [a for a in args if torch.is_tensor(a)]
            calls.append(
                {
                    "op": name,
                    "group": "default" if group is None else backend(group),
                    "devices": [t.device.type for t in tensors],
                    "waits": not kwargs.get("async_op", False),
                }
            )
            return real(*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name, getattr(dist, name)))

    steps: list[dict] = []
    real_train_step = train_module._train_step

    def counting_train_step(*args, **kwargs):
        steps.append({"first_call": len(calls)})
        with SyncCounter() as counter:
            result = real_train_step(*args, **kwargs)
        steps[-1]["syncs"] = counter.seen
        return result

    train_module._train_step = counting_train_step
    train_module.train(load_config(config, list(overrides)))
    path = Path(out) / f"rank_{os.environ['RANK']}.json"
    path.write_text(json.dumps({"calls": calls, "steps": steps}))


if __name__ == "__main__":
    main(*sys.argv[1:])
