"""Run by test_step_collectives.py under torchrun: `aiayn train` in this process, once under DDP
then once under DeepSpeed at each ZeRO stage, 0 to 3, and twice under FSDP2, in the same process
group (one launch: start-up is most of a launch's cost). Writes to OUT/rank_<r>.json, per run:
every collective the trainer calls through torch.distributed (op, group's backend, tensors'
devices); per optimizer step, where it began in that list, the host syncs inside it
(tests/syncs.py: the operator and the code that called it), how many of them came before
engine.step (in the micro-batches' forwards and backwards), and DeepSpeed's device syncs
(`get_accelerator().synchronize()`); and, under DeepSpeed, which of its own diagnostics the
engine has on.

The default group says it is NCCL (dist.get_backend() with no group), as it would on GPUs, so
DistEnv takes the path a GPU job takes; the group itself is gloo, as it must be on a CPU.

usage: step_collectives.py CONFIG OUT [overrides ...]
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for syncs.py

from aiayn.config import load_config  # noqa: E402
from aiayn.train import loop as train_module  # noqa: E402

from syncs import SyncCounter, accelerator_syncs  # noqa: E402

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
RUNS = {
    "ddp": [],
    **{
        f"zero{s}": ["distributed.backend=deepspeed", f"distributed.zero_stage={s}"]
        for s in range(4)
    },
    "fsdp": ["distributed.backend=fsdp"],
    # ZeRO-2's form (weights kept gathered from forward to backward), offloaded to the host.
    "fsdp_kept": [
        "distributed.backend=fsdp",
        "distributed.fsdp.reshard_after_forward=false",
        "distributed.fsdp.offload=true",
    ],
}


def deepspeed_diagnostics(engine) -> dict[str, bool]:
    """Which of DeepSpeed's reports about itself the engine has on: each costs time at every
    micro-batch or step, most of them a wait for the device (engine/deepspeed_config.py turns
    off the throughput timer, on by default; DeepSpeed's defaults keep the others off)."""
    from deepspeed.comm.comm import comms_logger

    ds = engine.model
    timer = ds.tput_timer.config
    return {
        "throughput_timer": timer.enabled,
        "throughput_timer_synchronized": timer.enabled and timer.synchronized,
        "wall_clock_breakdown": ds.wall_clock_breakdown(),
        "flops_profiler": ds.flops_profiler_enabled(),
        "comms_logger": comms_logger.enabled,
        "memory_breakdown": ds.memory_breakdown(),
        "monitor": ds.monitor.enabled,
    }


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
    diagnostics: dict[str, bool] = {}
    real_train_step = train_module._train_step

    def counting_train_step(run, *args, **kwargs):
        engine, before_step = run.engine, []
        real_step = engine.step

        def step():
            before_step.append((len(counter.seen), len(device_syncs)))
            return real_step()

        engine.step = step
        steps.append({"first_call": len(calls)})
        deepspeed = type(engine).__name__ == "DeepSpeedEngine"
        if deepspeed and not diagnostics:
            diagnostics.update(deepspeed_diagnostics(engine))
        try:
            waits = accelerator_syncs() if deepspeed else contextlib.nullcontext([])
            with waits as device_syncs, SyncCounter() as counter:
                result = real_train_step(run, *args, **kwargs)
        finally:
            del engine.step  # the class's method again
        steps[-1].update(
            syncs=counter.seen,
            sites=counter.sites,
            before_step=before_step[0][0],
            device_syncs=device_syncs,
            device_syncs_before_step=before_step[0][1],
        )
        return result

    train_module._train_step = counting_train_step
    # The runs share this process group (and DeepSpeed's groups made from it): the loop's
    # teardown waits for the last run.
    teardown, train_module.teardown = train_module.teardown, lambda: None
    runs = {}
    for name, options in RUNS.items():
        calls.clear()
        steps.clear()
        diagnostics.clear()
        run_dir = f"run_dir={Path(out) / name}"
        train_module.train(load_config(config, [*overrides, run_dir, *options]))
        runs[name] = {"calls": list(calls), "steps": list(steps), "diagnostics": dict(diagnostics)}
    teardown()
    path = Path(out) / f"rank_{os.environ['RANK']}.json"
    path.write_text(json.dumps(runs))


if __name__ == "__main__":
    main(*sys.argv[1:])
