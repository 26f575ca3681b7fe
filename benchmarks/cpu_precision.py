"""bf16 against fp32 on this CPU: the matmul peaks and aiayn's training step, interleaved.

    python benchmarks/cpu_precision.py                    # presets tiny and small
    python benchmarks/cpu_precision.py --presets small --repeats 7

What `train.precision=auto` decides from the CPU's flags (precision.py), measured: a CPU with
AVX512-BF16 or AMX multiplies bf16 in hardware and trains faster under bf16 autocast; one
without emulates bf16 and trains slower. The two trainers (the step train.py runs: model,
label-smoothed loss, fused Adam, the schedule) step through the same padded batches, in an
order rotated each repeat so a busy machine's slow phases fall on both; the table gives
target tokens/s (median, min - max) and the ratio of medians to fp32, measured in this run.
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    AiaynTrainer,
    fmt,
    interleaved,
    machine,
    markdown_table,
    run_config,
    set_threads,
    summary,
    time_steps,
)
from throughput import synthetic_batches

from aiayn.engine.precision import CPU_BF16_FLAGS, cpu_flags, resolve_precision
from aiayn.train.flops import matmul_dtype, measure_matmul_peak

PRECISIONS = ("fp32", "bf16")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--vocab", type=int, default=8000, help="joint vocabulary size")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch")
    p.add_argument("--batches", type=int, default=4, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per trainer")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--matmul-size",
        type=int,
        default=2048,
        help="n of the n^3 matmul whose best speed is the peak (smaller: a smoke test)",
    )
    args = p.parse_args(argv)
    set_threads(args.threads)
    cpu = torch.device("cpu")

    flags = sorted(set(CPU_BF16_FLAGS) & cpu_flags())
    print(f"Machine: {machine()}")
    print(
        f"bf16 flags: {', '.join(flags) or 'none'}; train.precision=auto chooses "
        f"{resolve_precision('auto', cpu)}"
    )
    size = args.matmul_size
    peaks = {p: measure_matmul_peak(cpu, matmul_dtype(p), size) for p in PRECISIONS}
    print(
        f"matmul peak ({size}^3): "
        + ", ".join(f"{n} {v / 1e9:.0f} GFLOP/s" for n, v in peaks.items())
        + f"; bf16/fp32 {peaks['bf16'] / peaks['fp32']:.2f}x\n"
    )

    rows = []
    batches = synthetic_batches(args.batches + args.warmup, args.max_tokens, args.vocab)
    warm, timed = batches[: args.warmup], batches[args.warmup :]
    tokens = sum(b.n_tokens for b in timed)
    for preset in args.presets:
        trainers = {}
        for precision in PRECISIONS:
            cfg = run_config(preset, max_tokens=args.max_tokens, seed=1, precision=precision)
            trainers[precision] = AiaynTrainer(cfg, args.vocab, name=precision)
            time_steps(trainers[precision].step, warm)
        seconds = interleaved(
            {n: (lambda t=t: time_steps(t.step, timed)) for n, t in trainers.items()},
            args.repeats,
        )
        base = summary([tokens / s for s in seconds["fp32"]])[0]
        for precision in PRECISIONS:
            med, lo, hi = summary([tokens / s for s in seconds[precision]])
            rows.append(
                [preset, precision, fmt(med), f"{fmt(lo)} - {fmt(hi)}", f"{med / base:.2f}x"]
            )
            print(markdown_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
    print(
        f"\n{args.batches} batches of <= {args.max_tokens} tokens, vocab {args.vocab}, x "
        f"{args.repeats} repeats (interleaved) after {args.warmup} warm-up steps\n"
    )
    print(markdown_table(HEADER, rows))


HEADER = ["preset", "precision", "target tokens/s (median)", "min - max", "vs fp32"]

if __name__ == "__main__":
    main()
