"""What each rank reads at a first start and a restart, and writes at a save, for W = 1-8.

    python benchmarks/scale.py                      # W = 1 2 4 8, a 64k-pair corpus in 8 files
    python benchmarks/scale.py --world 1 2 --pairs 16000
    python benchmarks/scale.py --world 1 --device cuda --preset transformer_big --zero 3 \
        --pairs 4000                                # a GPU's memory at a save and a validation

For each W, a run of the smallest model (gloo, on CPU) starts, builds its token cache, trains 2
steps and saves (first start), then the same command with 4 steps resumes from that checkpoint
(restart). Every rank runs under benchmarks/_scale_probe.py, which counts the bytes it read
from corpus files and how many it opened, the bytes it hashed (checkpoint and cache
verification, manifests), its metadata calls on the checkpoints (stats and folder listings) and
the bytes it gathered from the other ranks (aiayn.runtime.io_counts), its read(2) bytes
(imports included), what it wrote while saving the checkpoint (synchronously, at the end of
each phase), how far its memory rose during the save and during a validation (host, and CUDA
memory allocated with --device cuda: one GPU per rank, NCCL) and its peak memory. The tokenizer
is trained once beforehand, as `aiayn tokenizer train` would: its sample is rank 0's alone and
not part of what scales. The corpus is the generated numbers corpus cut into --files file
pairs, so that the cache build can split it by file (docs/data.md).

The table gives, per W and phase, the largest value over the ranks and the sum over them: a
figure whose per-rank maximum stays constant as W grows is one rank's share; one whose
maximum falls as 1/W is split; one whose sum grows with W is work repeated on every rank.

A second table splits the restart's start-up by phase (the start-up line's split,
aiayn/runtime/startup.py, each rank's kept by the probe) for rank 0 and the slowest rank at
each W. With --budget, the restart is then extrapolated to --budget-world ranks
(1,024) for transformer_big under ZeRO-3 with a WMT-sized token cache (_restart_budget.py):
each phase's seconds at the smallest W, scaled as the code scales it, at sha256's speed
measured here and the assumptions given as arguments. The measurements are kept in
WORKDIR/restart.json; --budget-from that file prints the budget again without running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _common import machine, markdown_table, torchrun
from _restart_report import (
    budget_arguments,
    cache_size,
    pair_cache,
    phase_table,
    print_budget,
    sha256_gbps,
    store_gets_per_s,
    store_multi_gets_per_s,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
PROBE = Path(__file__).with_name("_scale_probe.py")
STARTUP = re.compile(r"start-up ([\d.]+) s")
BUILT = re.compile(r"token cache .* built in ([\d.]+) s by (\d+) rank")
PASSED = ("PYTHONPATH", "LD_LIBRARY_PATH")
SAVED = re.compile(r"saved \S+ in ([\d.]+)s")


def make_corpus(root: Path, pairs: int, n_files: int) -> Path:
    from aiayn.corpora import demo

    corpus = demo.write_numbers(root / "numbers", n_train=pairs, n_valid=200, n_test=50)
    for lang in ("en", "de"):
        lines = (corpus / f"train.{lang}").read_text().splitlines(keepends=True)
        size = -(-len(lines) // n_files)
        for i in range(n_files):
            (corpus / f"part{i:02d}.{lang}").write_text("".join(lines[i * size : (i + 1) * size]))
    return corpus


def engine_name(args) -> str:
    if args.fsdp:
        return "FSDP2"
    return "DDP" if args.zero is None else f"DeepSpeed ZeRO-{args.zero}"


def make_config(root: Path, corpus: Path, args) -> Path:
    from aiayn.config import load_config
    from aiayn.data import sample_sentences
    from aiayn.tokenizer import train_tokenizer

    d, zero = args.d_model, args.zero
    model = (
        f"{{preset: {args.preset}, max_len: 64, dropout: 0.0}}"
        if args.preset
        else f"{{N: {args.layers}, d_model: {d}, d_ff: {2 * d}, h: 4, max_len: 64, dropout: 0.0}}"
    )
    precision = "bf16" if args.device == "cuda" else "fp32"
    config = root / "run.yaml"
    config.write_text(
        f"""
model: {model}
tokenizer: {{path: {root}/spm.model, vocab_size: 120}}
data: {{train: "{corpus}/part*", valid: {corpus}/valid, src_lang: en, tgt_lang: de,
        max_len: 40, shuffle_buffer: 1000}}
train: {{max_tokens: 600, eval_every: 2, eval_bleu: 0, threads: 1, device: {args.device},
         precision: {precision}}}
logging: {{every_steps: 1, peak_tflops: 1}}
checkpoint: {{every_steps: 2, async_save: false}}
"""
        + (
            "distributed: {backend: fsdp}\n"
            if args.fsdp
            else ""
            if zero is None
            else f"distributed: {{backend: deepspeed, zero_stage: {zero}"
            + (f", deepspeed_config: {args.deepspeed_config}" if args.deepspeed_config else "")
            + "}\n"
        )
    )
    cfg = load_config(config)
    train_tokenizer(
        cfg.tokenizer, sample_sentences(cfg.data, "seq2seq", 5000, 1), cfg.tokenizer_path
    )
    return config


def launch(
    world: int, config: Path, run_dir: Path, out: Path, steps: int, overrides: list[str]
) -> str:
    cmd = [
        *torchrun(world),
        str(PROBE),
        str(out),
        "train",
        "--config",
        str(config),
        f"run_dir={run_dir}",
        f"train.max_steps={steps}",
        *overrides,
    ]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    # What a GPU machine's packages and driver need (wheels on PYTHONPATH, CUDA libraries).
    env |= {k: v for k, v in os.environ.items() if k in PASSED or k.startswith(("CUDA_", "NCCL_"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"W={world}: the run failed\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def per_rank(got: list[dict], value) -> str:
    """Rank 0's value / the largest of the other ranks' ("-" at W = 1): a rank's must not grow
    with W; rank 0's gathers may (one small record per rank for the manifest)."""
    others = [value(r) for r in got[1:]]
    return f"{value(got[0]):,.0f} / " + (f"{max(others):,.0f}" if others else "-")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--pairs", type=int, default=64_000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    engine = p.add_mutually_exclusive_group()
    engine.add_argument("--zero", type=int, choices=[1, 2, 3], help="DeepSpeed ZeRO (default: DDP)")
    engine.add_argument("--fsdp", action="store_true", help="FSDP2 (default: DDP)")
    p.add_argument("--preset", help="a model preset (transformer_big) instead of --d-model")
    p.add_argument(
        "--deepspeed-config",
        help="a JSON file of DeepSpeed keys merged into the run's (distributed.deepspeed_config), "
        "e.g. ZeRO-3's stage3_max_live_parameters",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every run, e.g. train.malloc=system",
    )
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench" / "scale"))
    budget_arguments(p)
    args = p.parse_args(argv)
    if args.budget_from:
        print_budget(json.loads(Path(args.budget_from).read_text()), args)
        return
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = make_corpus(work, args.pairs, args.files)
    corpus_bytes = sum(f.stat().st_size for f in corpus.glob("part*"))
    config = make_config(work, corpus, args)
    print(f"Machine: {machine()}")
    print(
        f"Corpus: {args.pairs:,} pairs in {args.files} file pairs, {mib(corpus_bytes)} MiB; "
        f"model {args.preset or f'd_model {args.d_model}, N {args.layers}'}; "
        f"{engine_name(args)}, "
        f"{'NCCL, one GPU per rank, bf16' if args.device == 'cuda' else 'gloo on CPU, fp32'}, "
        "one thread per rank\n"
    )
    header = [
        "W",
        "phase",
        "corpus MiB read: max rank / all",
        "corpus files opened: max rank",
        "MiB hashed: max rank / all",
        "checkpoint stat calls + listings: rank 0 / max other",
        "KiB gathered from the others: rank 0 / max other",
        "read(2) MiB: max rank",
        "peak RSS MiB: max rank",
        "MiB written by the save: max rank / all",
        "save's allocated rise MiB: max rank",
        "validation's allocated rise MiB: max rank",
        *(["CUDA rise MiB, save / validation: max rank"] if args.device == "cuda" else []),
        "start-up s (rank 0)",
        "cache build s",
        "save s (rank 0)",
    ]
    rows, restart = [], {}
    for world in args.world:
        run_dir = work / f"w{world}"
        for phase, steps in (("first start", 2), ("restart", 4)):
            out = work / f"probe_w{world}_{phase.replace(' ', '_')}"
            launch(world, config, run_dir, out, steps, args.set)
            got = reports(out, world)
            log = (run_dir / "train.log").read_text()
            startup = STARTUP.findall(log)[-1]
            if phase == "restart":
                restart[world] = {
                    "splits": [r["startup_split"] for r in got],
                    "hashed": [r["hashed_bytes"] for r in got],
                }
            built = BUILT.findall(log) if phase == "first start" else []
            rows.append(
                [
                    str(world),
                    phase,
                    f"{mib(max(r['corpus_bytes'] for r in got))} / "
                    f"{mib(sum(r['corpus_bytes'] for r in got))}",
                    str(max(r["corpus_opens"] for r in got)),
                    f"{mib(max(r['hashed_bytes'] for r in got))} / "
                    f"{mib(sum(r['hashed_bytes'] for r in got))}",
                    per_rank(got, lambda r: r["ckpt_stat_calls"] + r["ckpt_listings"]),
                    per_rank(got, lambda r: r["ckpt_gathered_bytes"] / 1024),
                    mib(max(r["rchar"] or 0 for r in got)),
                    f"{max(r['peak_rss_mib'] for r in got):.0f}",
                    f"{mib(max(r['save_written'] for r in got))} / "
                    f"{mib(sum(r['save_written'] for r in got))}",
                    mib(max(r["save_peak_growth"] for r in got)),
                    mib(max(r["valid_peak_growth"] for r in got)),
                    *(
                        [
                            f"{mib(max(r['save_cuda_growth'] for r in got))} / "
                            f"{mib(max(r['valid_cuda_growth'] for r in got))}"
                        ]
                        if args.device == "cuda"
                        else []
                    ),
                    startup,
                    built[-1][0] if built else "-",
                    SAVED.findall(log)[-1],
                ]
            )
            print(markdown_table(header, rows[-1:]).splitlines()[-1], flush=True)
    weights = sorted(run_dir.glob("checkpoints/step_*/model.safetensors"))[-1]
    print(f"\nThe model: {mib(weights.stat().st_size)} MiB of weights (model.safetensors)\n")
    print(markdown_table(header, rows))
    print(
        "\nThe restart's start-up by phase, seconds (rank 0, and the rank whose total is "
        "largest):\n"
    )
    print(phase_table(restart))
    first = work / f"w{min(args.world)}"
    measured = {
        "pairs": args.pairs,
        "zero": args.zero,
        "preset": args.preset,
        # The checkpoint the restart verified and loaded (the first start's), whole: all ranks'
        # files, at the smallest W.
        "ckpt_bytes": sum(
            f.stat().st_size
            for f in sorted((first / "checkpoints").glob("step_*"))[0].rglob("*")
            if f.is_file()
        ),
        "cache_bytes": cache_size(first / "data_cache" / "train")[0],
        "pair_cache": pair_cache(first / "data_cache" / "train", args.pair_cache),
        "sha256_gbps": sha256_gbps(),
        "store_gets_per_s": store_gets_per_s(),
        "store_multi_gets_per_s": store_multi_gets_per_s(),
        "restart": restart,
    }
    (work / "restart.json").write_text(json.dumps(measured, indent=1))
    if args.budget:
        print_budget(measured, args)


if __name__ == "__main__":
    main()
