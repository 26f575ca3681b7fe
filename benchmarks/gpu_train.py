"""The real trainer on one device: data wait, checkpoint blocking, tokens/s and MFU.

    python benchmarks/gpu_train.py                          # transformer_base, bf16, CUDA
    python benchmarks/gpu_train.py --device cpu --preset tiny --max-tokens 2048 --steps 40 \\
        --precision fp32                                    # smoke test

`aiayn train` on Multi30k de-en (../shared/data/multi30k, or --corpus) from the token cache,
with the run's own BPE tokenizer (trained, and the cache built, by a first short run that is
not measured), then a measured run of --steps steps that saves asynchronously every
--save-every steps. From the run's TensorBoard scalars and log, after the first window (which
holds the first steps' warm-up): train/data_wait_fraction (the share of wall time rank 0
waited for its next batch), train/step_time_s, train/tokens_per_s, train/mfu, and each save's
"training blocked" time against the median step. The run is left in WORKDIR/run for
benchmarks/decode_speed.py.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def train(args, run_dir: Path, steps: int, *extra: str) -> None:
    corpus = Path(args.corpus)
    cmd = [
        sys.executable,
        "-m",
        "aiayn",
        "train",
        "--config",
        str(ROOT / "configs" / "multi30k_de_en.yaml"),
        f"run_dir={run_dir}",
        f"data.train={corpus}/train",
        f"data.valid={corpus}/val",
        f"data.test={corpus}/test_2016_flickr",
        f"data.cache_dir={Path(args.workdir) / 'cache'}",
        f"tokenizer.path={Path(args.workdir) / 'bpe8k.model'}",
        f"model.preset={args.preset}",
        "model.dropout=0.1",
        f"train.device={args.device}",
        f"train.precision={args.precision}",
        f"train.max_tokens={args.max_tokens}",
        f"train.max_steps={steps}",
        "train.eval_every=0",
        f"train.compile={str(args.compile).lower()}",
        f"logging.every_steps={args.log_every}",
        f"checkpoint.every_steps={args.save_every}",
        "checkpoint.keep_last=2",
        "checkpoint.async_save=true",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            f"aiayn train failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench" / "gpu_train"))
    p.add_argument("--out", default=None, help="copy train.log here")
    p.add_argument("--preset", default="transformer_base")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--precision", default="bf16")
    p.add_argument("--max-tokens", type=int, default=25000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args(argv)
    if not (Path(args.corpus) / "train.de.gz").is_file():
        p.error(f"no Multi30k at {args.corpus} (train.de.gz ...): pass --corpus")
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    # Tokenizer and token cache, unmeasured: a user's second start finds both.
    train(args, work / "prepare", 1)
    run_dir = work / "run"
    train(args, run_dir, args.steps)

    wait = scalars(run_dir, "train/data_wait_fraction")
    step_s = scalars(run_dir, "train/step_time_s")
    tps = scalars(run_dir, "train/tokens_per_s")
    mfu = scalars(run_dir, "train/mfu")
    later = [s for s in sorted(wait) if s > min(wait)]  # the first window holds the warm-up
    log = (run_dir / "train.log").read_text()
    if args.out:
        shutil.copy(run_dir / "train.log", Path(args.out) / "gpu_train.log")
    blocked = [float(x) for x in re.findall(r"checkpoint \d+: training blocked ([\d.]+)s", log)]
    step = statistics.median(step_s[s] for s in later)
    header = re.search(r"seq2seq model, .*", log)
    print(header.group() if header else "(no model line in the log)")
    print(
        f"\n{args.preset}, {args.precision} on {args.device}, <= {args.max_tokens} tokens per "
        f"step, {args.steps} steps, windows of {args.log_every} after the first\n"
    )
    print("| metric | median | min - max |")
    print("| --- | --- | --- |")
    for name, series, fmt in [
        ("data wait fraction", wait, "{:.2%}"),
        ("step time, s", step_s, "{:.4f}"),
        ("target tokens/s", tps, "{:,.0f}"),
        ("MFU", mfu, "{:.1%}"),
    ]:
        values = [series[s] for s in later]
        lo, med, hi = min(values), statistics.median(values), max(values)
        print(f"| {name} | {fmt.format(med)} | {fmt.format(lo)} - {fmt.format(hi)} |")
    if blocked:
        later_saves = blocked[1:] or blocked  # the first also allocates the reused host buffers
        med = statistics.median(later_saves)
        print(
            f"| checkpoint save after the first: training blocked, s | {med:.3f} | "
            f"{min(later_saves):.3f} - {max(later_saves):.3f} ({med / step:.0%} of a median "
            f"step; the first save {blocked[0]:.3f}) |"
        )
        print("\nWhere each save blocked the loop (train.log):")
        for line in re.findall(r"checkpoint \d+: training blocked .*", log):
            print(f"- {line}")
    else:
        print("| checkpoint save: training blocked | none logged | |")


if __name__ == "__main__":
    main()
