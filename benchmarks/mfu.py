"""Model FLOPs utilisation of aiayn's training step on one GPU, eager and under train.compile.

    python benchmarks/mfu.py                                   # CUDA: base and big, bf16
    python benchmarks/mfu.py --presets transformer_big --max-tokens 32768
    python benchmarks/mfu.py --device cpu --presets tiny --precision fp32 --quick   # smoke test
    python benchmarks/mfu.py --no-compile --profile runs/bench/profile   # + where the time goes

For each preset, the trainer that train.py runs (model, label-smoothed loss, LocalEngine with
fused Adam and the warmup schedule) steps through padded batches of similar-length sentences,
made as throughput.py makes them. Warm-up steps (which compile, for train.compile=true) are
excluded; the table gives the median, min and max over repeats of target tokens/s and MFU.

MFU counts the matrix multiplies that aiayn executes (aiayn.train.flops.training_flops: padded
shapes, the output projection on non-pad targets only) against the device's dense peak in the
run's arithmetic, as the trainer's train/mfu does (aiayn.train.flops.datasheet_peak): the vendor's
data sheet on a known GPU (bf16 989 TFLOP/s, TF32 for fp32 495 TFLOP/s on an H100 or H200
SXM), else a matrix multiply measured here. The measured peak is printed too, so the table
also gives the fraction of what this device's matmul reaches.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import itertools
import shutil
import time
from pathlib import Path

import torch
from _common import AiaynTrainer, fmt, machine, markdown_table, run_config, summary
from throughput import synthetic_batches

from aiayn.runtime.torch_settings import use_attention_kernel, use_tf32
from aiayn.train.flops import datasheet_peak, matmul_dtype, measure_matmul_peak, training_flops


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MODES = {"eager": False, "compile": True}


def mode_name(compile: bool) -> str:
    return "compile" if compile else "eager"


def profile(trainer, batches: list, device: torch.device, stem: Path) -> None:
    """torch.profiler over a few steps: the operators by device time (a table to read) and a
    Chrome trace (gzip: chrome://tracing or ui.perfetto.dev)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profiler(activities=activities, record_shapes=True) as prof:
        for batch in batches:
            trainer.step(batch)
        sync(device)
    stem.parent.mkdir(parents=True, exist_ok=True)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=70)
    stem.with_suffix(".txt").write_text(table)
    trace = stem.with_suffix(".json")
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    print(f"profile of {len(batches)} steps: {stem}.txt, {trace}.gz", flush=True)


def bench(preset: str, compile: bool, args, device: torch.device, kernel: str) -> dict:
    """Time one trainer: warm-up steps, then `repeats` passes over the timed batches."""
    cfg = run_config(
        preset,
        max_tokens=args.max_tokens,
        seed=1,
        precision=args.precision,
        compile=compile,
        device=device.type,
    )
    batches = synthetic_batches(args.batches + args.warmup, args.max_tokens, args.vocab)
    batches = [b.to(device) for b in batches]
    trainer = AiaynTrainer(cfg, args.vocab, device=device.type)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for batch in batches[: args.warmup]:
        trainer.step(batch)
    timed = batches[args.warmup :]
    tokens = sum(b.n_tokens for b in timed)
    flops = sum(training_flops(cfg.model, args.vocab, b) for b in timed)
    seconds = []
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        for batch in timed:
            trainer.step(batch)
        sync(device)
        seconds.append(time.perf_counter() - start)
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if args.profile:
        stem = f"{preset}_{mode_name(compile)}" + ("" if kernel == "auto" else f"_{kernel}")
        profile(trainer, timed[:3], device, Path(args.profile) / stem)
    n_params = sum(p.numel() for p in trainer.engine.module.parameters())
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "seconds": seconds,
        "tokens": tokens,
        "flops": flops,
        "memory": memory,
        "params": n_params,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["transformer_base", "transformer_big"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--vocab", type=int, default=32000, help="joint vocabulary size")
    p.add_argument(
        "--max-tokens", type=int, default=16384, help="tokens per batch, padding included"
    )
    p.add_argument("--batches", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (compiling included)")
    p.add_argument("--modes", nargs="+", default=["eager", "compile"], choices=MODES)
    p.add_argument("--no-compile", action="store_true", help="eager only (--modes eager)")
    p.add_argument(
        "--attention-kernels",
        nargs="+",
        default=["auto"],
        choices=["auto", "cudnn", "flash", "efficient", "math"],
        help="a row for each (train.attention_kernel; CUDA only)",
    )
    p.add_argument("--quick", action="store_true", help="2 batches x 2 repeats, 3 warm-up steps")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after timing, profile 3 steps of each row: DIR/<preset>_<mode>.txt (operators by "
        "device time) and .json.gz (Chrome trace)",
    )
    args = p.parse_args(argv)
    if args.quick:  # warm-up still sees several shapes: compile turns dynamic on the second
        args.batches, args.repeats, args.warmup = 2, 2, 3
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device is visible; --device cpu runs the same steps on the CPU")
    device = torch.device(args.device)
    if device.type == "cuda":
        use_tf32(True)  # as the trainer does by default (train.tf32): fp32 rows in TF32
    dtype = matmul_dtype(args.precision, device.type)
    measured = measure_matmul_peak(device, dtype)
    # A data sheet's figure where there is one; else what was just measured (one measurement:
    # two would differ by the machine's noise).
    peak = datasheet_peak(device, args.precision) or measured
    where = (
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
        if device.type == "cuda"
        else machine()
    )
    print(
        f"Device: {where}; {args.precision}; MFU against {peak / 1e12:.3g} TFLOP/s; measured "
        f"{str(dtype).removeprefix('torch.')} matmul peak {measured / 1e12:.3g} TFLOP/s\n"
    )
    rows = []
    for preset in args.presets:
        modes = ["eager"] if args.no_compile else args.modes
        for kernel, compile in itertools.product(args.attention_kernels, [MODES[m] for m in modes]):
            if device.type == "cuda":
                use_attention_kernel(kernel)
            r = bench(preset, compile, args, device, kernel)
            med, lo, hi = summary([r["tokens"] / s for s in r["seconds"]])
            achieved = r["flops"] / summary(r["seconds"])[0]
            mfus = [r["flops"] / s / peak for s in r["seconds"]]
            rows.append(
                [
                    preset,
                    f"{r['params'] / 1e6:.0f}M",
                    "train.compile" if compile else "eager",
                    kernel,
                    fmt(med),
                    f"{fmt(lo)} - {fmt(hi)}",
                    f"{achieved / 1e12:.3g}",
                    f"{100 * summary(mfus)[0]:.1f}%",
                    f"{100 * achieved / measured:.0f}%",
                    "n/a" if r["memory"] is None else f"{r['memory']:.1f}",
                ]
            )
            print(markdown_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
    print(
        f"\n{args.batches} batches of <= {args.max_tokens} tokens, vocab {args.vocab}, x "
        f"{args.repeats} repeats after {args.warmup} warm-up steps\n"
    )
    print(markdown_table(HEADER, rows))


HEADER = [
    "preset",
    "parameters",
    "mode",
    "attention kernel",
    "target tokens/s (median)",
    "min - max",
    "TFLOP/s",
    "MFU",
    "of measured matmul peak",
    "peak memory GiB",
]

if __name__ == "__main__":
    main()
