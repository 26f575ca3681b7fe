"""Does each rank's input work fall as 1/W? And how fast is the token cache built?

    python benchmarks/data_world.py                  # Multi30k; prepare speed on 4.5M pairs
    python benchmarks/data_world.py --pairs 300000   # a smaller prepare corpus
    python benchmarks/data_world.py --quick          # 2 repeats, 100k pairs: a smoke test
    python benchmarks/data_world.py --world-only     # the world table alone (no 4.5M-pair build)

Three tables:
  world     rank 0 of W = 1, 2, 8, 32, 64, simulated in one process: seconds for one epoch of
            its batches and target tokens/s delivered to it, from the token cache (the first
            epoch, whose plan rank 0 makes on the spot, and the next ones: on nodes of up to 8
            ranks, each epoch's plan is made ahead by the node's local rank epoch mod 8 and
            memory-mapped by the others, data/plan_files.py; the other ranks' plans are written
            before rank 0's epochs are timed, rank 0's own, epoch 8's, during epoch 7) and from
            the streaming loader (data.cache=false). Goals (issues 16, 54), cached: W=8 at most
            0.2x W=1, W=32 at most 0.06x; at least 5M target tokens/s.
  prepare   `ensure_cache` (what `aiayn data prepare` runs) on a corpus the size of WMT14
            en-de (4.5M pairs) made by repeating Multi30k under runs/bench/ (never committed),
            pinned to one core and then on all cores. Goal: at least 1.7x one core.
  memory    for that corpus, per rank: the index's and the plans' arrays (live and peak), the
            private resident memory, and the mapped cache pages read. Goal: at most 200 MB.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import logging
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
from _common import fmt, machine, markdown_table, summary

from aiayn.config import load_config
from aiayn.data import ensure_cache, make_loader
from aiayn.data.prepare import prepare_tokenizer
from aiayn.data.splits import open_split
from aiayn.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
WORLDS = (1, 2, 8, 32, 64)
NODE = 8  # ranks per node in the simulation (8 GPUs a node): a node's ranks take turns to plan


def config(train: Path, cache: Path, max_tokens: int):
    return load_config(
        ROOT / "configs/multi30k_de_en.yaml",
        [
            f"data.train={train}",
            f"data.cache_dir={cache}",
            f"train.max_tokens={max_tokens}",
            "tokenizer.path=" + str(ROOT / "runs/bench/multi30k_bpe8k.model"),
        ],
    )


def cached_epochs(loader, epochs: int) -> tuple[float, list[float], float, int]:
    """Seconds of rank 0's first epoch (its plan included), of each of the `epochs` after it
    (their plans made ahead, in the loader's background thread), the CPU seconds of one of those
    (the process's, every thread's: a figure a shared machine stretches less than the wall
    clock), and target tokens of one."""
    splits, tokens, cpu = [time.perf_counter()], 0, []
    for batch in loader:
        if loader.epoch == len(splits):  # the first batch of the next epoch
            splits.append(time.perf_counter())
            cpu.append(time.process_time())
            if len(splits) == epochs + 2:
                break
        if loader.epoch == 0:
            tokens += batch.n_tokens
    times = np.diff(splits).tolist()
    return times[0], times[1:], (cpu[-1] - cpu[0]) / epochs, tokens


def other_planners(cfg, tok, cache, W: int, epochs: int) -> None:
    """The plan files that the other ranks of rank 0's node write (data/plan_files.py): epoch
    e's by local rank e mod L, for epochs 0 .. epochs - 1 but rank 0's own. Written before rank
    0's epochs are timed: in a job it is their work, on their cores. Without their pruning, which
    would delete the early epochs' plans before rank 0 reads them (in a job, epoch e is written
    while the ranks are in e - 1, and the plans before e - 2 are deleted then)."""
    L = min(W, NODE)
    for e in range(epochs):
        if e % L:
            kw = dict(rank=e % L, world_size=W, local_rank=e % L, local_world_size=L)
            planner = make_loader(cfg, cfg.data.train, tok, train=True, cache=cache, **kw)
            planner.rows._plan_files._prune = lambda epoch: None
            planner.rows.plan(e)


def streamed_epoch(loader) -> tuple[float, int]:
    """Seconds and target tokens of rank 0's batches of epoch 0 from a fresh streaming loader."""
    start, tokens = time.perf_counter(), 0
    for batch in itertools.takewhile(lambda _: loader.epoch == 0, loader):
        tokens += batch.n_tokens
    return time.perf_counter() - start, tokens


def world_table(cfg, tok, repeats: int) -> str:
    cache = ensure_cache(cfg, "train", tok)
    rows, base = [], {}
    epochs = max(repeats, NODE)  # a node's turn of planners: rank 0 plans epoch 8 in epoch 7
    for W in WORLDS:

        def loader(cached: bool, W: int = W):
            c = cache if cached else None
            node = dict(local_rank=0, local_world_size=min(W, NODE))
            return make_loader(
                cfg, cfg.data.train, tok, train=True, rank=0, world_size=W, cache=c, **node
            )

        shutil.rmtree(cache.root.parent / f"{cache.root.name}.plans", ignore_errors=True)
        other_planners(cfg, tok, cache, W, epochs + 1)
        first, steady, cpu, tokens = cached_epochs(loader(True), epochs)
        med, lo, hi = summary(steady)
        base.setdefault("cache", med)
        base.setdefault("cache cpu", cpu)
        row = [str(W), f"{first:.4f}", f"{med:.4f} ({lo:.4f}-{hi:.4f})"]
        row += [f"{med / base['cache']:.3f}x", f"{cpu:.4f}", f"{cpu / base['cache cpu']:.3f}x"]
        row += [fmt(tokens / med)]
        times = []
        for _ in range(repeats):
            seconds, tokens = streamed_epoch(loader(False))
            times.append(seconds)
        med, lo, hi = summary(times)
        base.setdefault("stream", med)
        row += [f"{med:.4f} ({lo:.4f}-{hi:.4f})", f"{med / base['stream']:.3f}x"]
        rows.append(row + [fmt(tokens / med)])
    header = ["W", "cached: first epoch s", "cached: s/epoch (min-max)", "vs W=1"]
    header += ["CPU s/epoch", "vs W=1", "tok/s"]
    header += ["streamed: s/epoch (min-max)", "vs W=1", "tok/s"]
    note = (
        "Target tokens/s delivered to rank 0. Cached, first epoch: its plan made on the spot; "
        f"s/epoch: the {epochs} epochs after it (median), whose plans the node's other ranks "
        "made (written before the timing) or rank 0 made ahead in its background thread (epoch "
        "8's, during epoch 7, and every epoch's at W=1); CPU s/epoch: the process's CPU time "
        "over those epochs, every thread's, per epoch."
    )
    return markdown_table(header, rows) + "\n\n" + note


def big_corpus(pairs: int) -> Path:
    """Multi30k train repeated to `pairs` lines per side, plain text, under runs/bench/."""
    out = ROOT / "runs" / "bench" / f"repeated_{pairs}"
    if (out / "train.en").is_file():
        return out / "train"
    out.mkdir(parents=True, exist_ok=True)
    for lang in ("de", "en"):
        lines = gzip.open(MULTI30K / f"train.{lang}.gz", "rt", encoding="utf-8").readlines()
        with open(out / f"train.{lang}.tmp", "w", encoding="utf-8") as fh:
            for i in range(pairs):
                fh.write(lines[i % len(lines)])
        os.replace(out / f"train.{lang}.tmp", out / f"train.{lang}")
    return out / "train"


def prepare_table(cfg, tok, pairs: int) -> tuple[str, object]:
    cores = sorted(os.sched_getaffinity(0))
    rows, rates, cache = [], {}, None
    read_start = time.perf_counter()
    n = sum(1 for _ in open_split(cfg.data, cfg.data.train, "seq2seq").dataset())
    read_rate = n / (time.perf_counter() - read_start)
    for label, use in (("1 core", cores[:1]), (f"{len(cores)} cores", cores)):
        os.sched_setaffinity(0, use)
        try:
            start = time.perf_counter()
            cache = ensure_cache(cfg, "train", tok, rebuild=True)
            seconds = time.perf_counter() - start
        finally:
            os.sched_setaffinity(0, cores)
        c = cache.counts()
        rates[label] = c["examples"] / seconds
        tokens = c["src_tokens"] + c["tgt_tokens"]
        rows.append([label, f"{seconds:.1f}", fmt(c["examples"] / seconds), fmt(tokens / seconds)])
    speedup = rates[f"{len(cores)} cores"] / rates["1 core"]
    rows.append(["speed-up", "", f"{speedup:.2f}x", ""])
    # A 64-core node, 8 ranks of 8 threads: each rank reads the whole stream (datasets, one
    # Python thread) and tokenises 1/8 of it; tokenising scales with cores, reading does not.
    tokenise_core_s = n / rates["1 core"] - n / read_rate  # one core's tokenising time
    projected = max(n / read_rate, tokenise_core_s / 64)
    note = (
        f"Reading alone (datasets stream, one thread): {fmt(read_rate)} pairs/s. Projected on a "
        f"64-core node (8 ranks x 8 threads; every rank reads the stream, the tokenising is "
        f"split): max(read {n / read_rate:.0f} s, tokenise {tokenise_core_s:.0f} core-s / 64) "
        f"= {projected:.0f} s for {fmt(n)} pairs."
    )
    table = markdown_table(["prepare", "seconds", "pairs/s", "tokens/s"], rows)
    return table + "\n\n" + note, cache


def memory_table(cfg, tok, cache) -> str:
    """Memory of rank 0 of 8 while it reads its first epoch: the index's and the plans' arrays
    (live and peak, as numpy allocated them: tracemalloc), the private resident memory they
    left (the allocator keeps some freed memory, per thread arena), and the mapped cache pages
    the rank touched (page cache: shared by the ranks of a node, evictable). Opening (and
    verifying) the cache happened before: its hashing reads through the page cache."""

    def status() -> dict[str, int]:
        with open("/proc/self/status") as fh:
            fields = (line.split() for line in fh)
            return {f[0][:-1]: int(f[1]) * 1024 for f in fields if len(f) == 3 and f[2] == "kB"}

    before = status()
    tracemalloc.start()

    def row(what: str) -> list[str]:
        now, (live, peak) = status(), tracemalloc.get_traced_memory()
        private = now["RssAnon"] - before["RssAnon"]
        mapped = now["RssFile"] - before["RssFile"]
        return [what] + [fmt(x / 1e6, 1) for x in (live, peak, private, mapped)]

    ld = make_loader(cfg, cfg.data.train, tok, train=True, rank=0, world_size=8, cache=cache)
    rows = [row("index: widths and kept examples")]
    batches = iter(ld)
    next(batches)
    rows.append(row("+ epoch 0's plan, epoch 1's planned ahead, first batch"))
    while ld.epoch == 0:
        next(batches)
    time.sleep(1)  # epoch 2's plan, started at epoch 1's first batch, finishes
    rows.append(row("after epoch 0 (plans of epochs 1 and 2 held)"))
    header = [f"rank 0 of 8, {fmt(len(cache))} pairs", "arrays MB", "arrays peak MB"]
    header += ["private resident MB", "mapped cache MB"]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=4_500_000, help="pairs of the prepare corpus")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="2 repeats, 100k pairs")
    p.add_argument("--world-only", action="store_true", help="the world table alone")
    p.add_argument("--memory-of", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_of:
        big = config(
            big_corpus(args.memory_of),
            ROOT / "runs/bench" / f"cache_{args.memory_of}",
            args.max_tokens,
        )
        tok = Tokenizer(big.tokenizer_path)
        print(memory_table(big, tok, ensure_cache(big, "train", tok)))
        return
    if args.quick:
        args.repeats, args.pairs = 2, 100_000
    if not MULTI30K.is_dir():
        raise SystemExit(f"needs Multi30k in {MULTI30K} (the shared data folder)")
    logging.basicConfig(level=logging.WARNING)
    bench = ROOT / "runs" / "bench"
    cfg = config(MULTI30K / "train", bench / "cache_multi30k", args.max_tokens)
    tok = prepare_tokenizer(cfg)
    print(f"Machine: {machine()}\n")
    epochs = max(args.repeats, NODE)
    print(f"Multi30k de-en train, max_tokens {args.max_tokens}, median of {args.repeats}", end="")
    print(f" (cached: of {epochs} epochs):\n")
    print(world_table(cfg, tok, args.repeats) + "\n")
    if args.world_only:
        return
    big = config(big_corpus(args.pairs), bench / f"cache_{args.pairs}", args.max_tokens)
    table, cache = prepare_table(big, tok, args.pairs)
    print(table + "\n")
    # In a fresh process: this one's heap already holds freed memory from the build.
    cmd = [sys.executable, __file__, "--memory-of", str(args.pairs), "--max-tokens"]
    print(
        subprocess.run(
            cmd + [str(args.max_tokens)], check=True, capture_output=True, text=True
        ).stdout
    )


if __name__ == "__main__":
    main()
