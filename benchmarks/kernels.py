"""aiayn's own loss and dropout against the torch functions they replace, one call at a time.

    python benchmarks/kernels.py            # ~1 min on 2 cores

- loss: label-smoothed cross-entropy over (N, V) logits, forward and backward, plus the argmax
  the trainer logs accuracy from: F.cross_entropy(label_smoothing=0.1) + argmax against
  aiayn.engine.loss.smoothed_cross_entropy (which returns whether each row's argmax is its target).
- dropout: p = 0.1 on a (N, d_model) activation: F.dropout against aiayn.model.dropout.Dropout.

Interleaved repeats; the table gives the median milliseconds per call with min and max. Both
contenders run under the allocator policy training uses on CPU (`--malloc keep`, see
aiayn/runtime/malloc.py); `--malloc system` leaves glibc's default.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F
from _common import fmt, interleaved, machine, markdown_table, set_threads, summary

from aiayn.engine.loss import smoothed_cross_entropy
from aiayn.model.dropout import Dropout
from aiayn.runtime.malloc import keep_freed_memory


def _ms(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=3600, help="target tokens N (a 4096-token batch)")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--calls", type=int, default=10, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--malloc", choices=["keep", "system"], default="keep")
    args = p.parse_args(argv)
    set_threads(args.threads)
    if args.malloc == "keep":
        keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen).requires_grad_()
    target = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    x = torch.randn(args.rows, args.d_model, generator=gen)
    ours_dropout = Dropout(0.1).train()

    def torch_loss():
        loss = F.cross_entropy(logits, target, label_smoothing=0.1, reduction="sum")
        logits.detach().argmax(-1)
        torch.autograd.grad(loss, logits)

    def aiayn_loss():
        loss, _ = smoothed_cross_entropy(logits, target, 0.1)
        torch.autograd.grad(loss, logits)

    pairs = {
        "loss": {
            "F.cross_entropy + argmax": torch_loss,
            "aiayn smoothed_cross_entropy": aiayn_loss,
        },
        "dropout": {
            "F.dropout": lambda: F.dropout(x, 0.1, training=True),
            "aiayn Dropout": lambda: ours_dropout(x),
        },
    }
    rows = []
    for what, contenders in pairs.items():
        for fn in contenders.values():
            fn()  # warm-up
        timed = {n: partial(_ms, fn, args.calls) for n, fn in contenders.items()}
        times = interleaved(timed, args.repeats)
        base = summary(times[next(iter(times))])[0]  # the first contender is torch's
        for n, ms in times.items():
            med, lo, hi = summary(ms)
            rows.append(
                [what, n, fmt(med, 1), f"{fmt(lo, 1)} - {fmt(hi, 1)}", f"{med / base:.2f}x"]
            )
    print(f"Machine: {machine()}\n")
    print(
        f"logits ({args.rows}, {args.vocab}); activation ({args.rows}, {args.d_model}); "
        f"{args.calls} calls x {args.repeats} repeats; malloc {args.malloc}\n"
    )
    print(
        markdown_table(
            ["what", "function", "ms per call (median)", "min - max", "time vs torch"], rows
        )
    )


if __name__ == "__main__":
    main()
