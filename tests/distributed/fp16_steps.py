"""A few fp16 optimizer steps through `build_engine`, two micro-batches per step, one of them
overflowing at step OVERFLOW_STEP; writes this rank's weights and loss-scale state to OUT.

Under torchrun (2 ranks, gloo) each rank takes the micro-batch of its rank; alone, the
process takes both, accumulating (train.grad_accum=2): the two must train alike.
Usage: python fp16_steps.py OUT
"""

import sys
from pathlib import Path

import torch

from aiayn.config import load_config
from aiayn.distributed import env as dist_env
from aiayn.engine import build_engine
from aiayn.engine.loss import batch_loss
from aiayn.model import build_model

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers.py, for batches.py
sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from batches import TINY, padded_batch  # noqa: E402  (tests/unit/batches.py)

STEPS = 4
OVERFLOW_STEP = 2  # its second micro-batch (rank 1's) overflows: the whole step is skipped
FP16 = [
    *TINY,
    "model.dropout=0",
    "train.precision=fp16",
    "schedule.warmup=4",
    "train.ema=0.5",  # an average of the applied steps only: not moved by the skipped one
    "train.ema_warmup=false",
]


def main(out: Path) -> None:
    env = dist_env.setup("cpu")
    cfg = load_config(None, [*FP16, f"train.grad_accum={2 // env.world_size}"])
    torch.manual_seed(0)
    engine = build_engine(build_model(cfg.model, 50, 0), cfg, env)
    initial = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    buffers = {k: v.clone() for k, v in engine.module.named_buffers()}
    mine = [env.rank] if env.distributed else [0, 1]
    after = []  # the weights after each step
    for step in range(1, STEPS + 1):
        batches = [padded_batch(rows=4 + m, seed=10 * step + m) for m in (0, 1)]
        tokens = sum(b.n_tokens for b in batches)  # the loop's divisor: all ranks' tokens
        for i, m in enumerate(mine):
            with engine.accumulating(last=i == len(mine) - 1):
                with engine.autocast():
                    loss, _ = batch_loss(engine.model, batches[m], "seq2seq", 0.1, 0)
                if step == OVERFLOW_STEP and m == 1:
                    loss = loss * float("inf")
                engine.backward(loss / tokens)
        engine.step()
        after.append([p.detach().clone() for p in engine.module.parameters()])
    torch.save(
        {
            "weights": {k: v.detach().clone() for k, v in engine.module.named_parameters()},
            "after": after,
            "ema": [t.clone() for t in engine.ema.shadow],
            "ema_updates": engine.ema.updates,
            "initial": initial,
            "skipped_steps": engine.skipped_steps,
            "loss_scale": engine.loss_scale,
            "lr": engine.lr,
            "buffers_before": buffers,
            "buffers_after": dict(engine.module.named_buffers()),
            "syncs_buffers": getattr(engine.model, "will_sync_module_buffers", bool)(),
        },
        out / f"rank_{env.rank}.pt",
    )
    dist_env.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
