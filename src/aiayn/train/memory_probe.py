"""Try the epoch's largest batches before training, so that an out-of-memory error comes in the
first minute of a run rather than at the first such batch, hours in.

The data order is not changed for it (that would change the run, and the resume of older
checkpoints): the probe runs a forward and backward pass of those batches on the side, in
training mode, with every random generator forked (dropout draws, then the generators are as
before), and gradients taken with torch.autograd.grad, so no parameter's .grad, no DDP or
DeepSpeed hook and no optimizer sees them. Training after it is the same as without it.
"""

from __future__ import annotations

import logging
import time

import torch

from aiayn.data.batch import Batch
from aiayn.engine.loss import batch_loss
from aiayn.errors import TrainingError

log = logging.getLogger("aiayn")


def wanted(setting: str, device: torch.device, partitioned: bool) -> bool:
    """train.memory_probe on this device. A partitioned engine (ZeRO-3) gathers parameters in
    hooks of its own around each module, in collectives every rank must take part in: a pass
    outside its step would not be the pass it runs, and ranks probing different numbers of
    batches would wait for each other."""
    if setting == "never" or partitioned:
        return False
    return setting == "always" or device.type == "cuda"


def probe(
    engine, batches: list[Batch], kind: str, smoothing: float, pad_id: int, device: torch.device
) -> list[dict]:
    """One forward and backward pass of each batch; what each one measured."""
    module = engine.module
    params = [p for p in module.parameters() if p.requires_grad]
    was_training = module.training
    module.train()
    cuda = device.type == "cuda"
    # A new run's optimizer has no state yet (Adam makes it at the first step): hold its size
    # during the probe, so the peak is that of a step later in the run.
    held = _optimizer_state_stand_in(engine, params) if cuda else []
    results = []
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
        for batch in batches:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            try:
                _forward_backward(engine, module, params, batch, kind, smoothing, pad_id, device)
            except torch.OutOfMemoryError as exc:
                raise TrainingError(
                    f"the epoch's largest batch, of shape {shape_of(batch)}, does not fit in "
                    f"{device}'s memory: lower train.max_tokens (to a divisor of "
                    "train.tokens_per_step, which keeps the step's tokens; or raise "
                    "train.grad_accum with it), or set distributed.activation_checkpointing=true"
                ) from exc
            results.append(_measured(batch, device, time.perf_counter() - started))
    del held
    module.train(was_training)
    for r in results:
        log.info(
            "memory probe: batch of shape %s (%d padded tokens): peak allocated %.2f GiB, "
            "reserved %.2f GiB, %.2f s",
            r["shape"],
            r["padded_tokens"],
            r["peak_allocated"] / 2**30,
            r["reserved"] / 2**30,
            r["seconds"],
        )
    return results


def _forward_backward(engine, module, params, batch, kind, smoothing, pad_id, device) -> None:
    with engine.autocast():
        loss, _ = batch_loss(module, batch.to(device), kind, smoothing, pad_id)
    torch.autograd.grad(loss, params, allow_unused=True)  # dropped at once


def _optimizer_state_stand_in(engine, params: list[torch.Tensor]) -> list[torch.Tensor]:
    optimizer = getattr(engine, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or optimizer.state:
        return []
    return [torch.empty_like(p, dtype=torch.float32) for p in params for _ in range(2)]


def shape_of(batch: Batch) -> tuple[int, ...]:
    """(rows, source width, target width), with the widths a model kind does not have left out."""
    widths = [t.shape[1] for t in (batch.src, batch.tgt_in) if t is not None]
    return (batch.size, *widths)


def _measured(batch: Batch, device: torch.device, seconds: float) -> dict:
    shape = shape_of(batch)
    cuda = device.type == "cuda"
    return {
        "shape": shape,
        "padded_tokens": shape[0] * sum(shape[1:]),
        "peak_allocated": float(torch.cuda.max_memory_allocated(device)) if cuda else 0.0,
        "reserved": float(torch.cuda.memory_reserved(device)) if cuda else 0.0,
        "seconds": seconds,
    }
