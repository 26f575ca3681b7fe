"""Is the data pipeline ever what the model waits for?

    python benchmarks/data_pipeline.py             # Multi30k if ../shared/data/multi30k exists
    python benchmarks/data_pipeline.py --quick     # fewer steps and repeats: a smoke test

Rates in target tokens/s (non-pad tokens of tgt_out) on a real corpus, for each loader: the
token cache's loader (data.cache=true, the default) and the streaming one
(data.cache=false):
  pipeline   the loader alone, one pass over the training split, nothing else running (the
             cache is built before, untimed: `aiayn data prepare`);
  in-memory  training on the loader's first batches, held in a list: what the model consumes
             when it never waits;
  loader     training fed by the live loader, on the same batches.
Goals (issues 7 and 16): pipeline >= 10x the model's consumption, loader >= 0.98x in-memory.

The corpus is Multi30k (configs/multi30k_de_en.yaml) when ../shared/data/multi30k is present,
else the generated numbers corpus (written under runs/bench/). The tokenizer (joint BPE) is
trained once and cached under runs/bench/. data.shuffle_buffer defaults to 2000 here, smaller
than the config's, so that several chunks are read and tokenised inside every timed window.
The process keeps freed host memory, as `aiayn train` does on CPU (aiayn/runtime/malloc.py).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import (
    AiaynTrainer,
    fmt,
    interleaved,
    machine,
    markdown_table,
    set_threads,
    summary,
    time_steps,
)

from aiayn.config import Config, load_config
from aiayn.corpora import demo
from aiayn.data import ensure_cache, make_loader
from aiayn.data.prepare import prepare_tokenizer
from aiayn.runtime.malloc import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"


def bench_config(args) -> tuple[Config, str]:
    over = [
        f"data.shuffle_buffer={args.shuffle_buffer}",
        f"train.max_tokens={args.max_tokens}",
        f"model.preset={args.preset}",
    ]
    if MULTI30K.is_dir() and not args.numbers:
        over += [
            f"data.train={MULTI30K / 'train'}",
            f"data.cache_dir={ROOT / 'runs/bench/cache_multi30k'}",
            "tokenizer.path=" + str(ROOT / "runs/bench/multi30k_bpe8k.model"),
        ]
        return load_config(ROOT / "configs/multi30k_de_en.yaml", over), "Multi30k de-en train"
    numbers = demo.write_numbers(ROOT / "runs/bench/numbers")
    over += [
        f"data.train={numbers / 'train'}",
        f"data.cache_dir={ROOT / 'runs/bench/cache_numbers'}",
        "tokenizer.path=" + str(ROOT / "runs/bench/numbers_unigram200.model"),
        "model.max_len=256",
    ]
    return load_config(ROOT / "configs/demo.yaml", over), "generated numbers en-de train"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="small", help="model preset (default: small)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch")
    p.add_argument("--shuffle-buffer", type=int, default=2000, help="examples per chunk")
    p.add_argument("--steps", type=int, default=30, help="timed training steps per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--numbers", action="store_true", help="use the numbers corpus")
    p.add_argument("--quick", action="store_true", help="8 steps x 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 8, 2
    set_threads(args.threads)
    keep_freed_memory()
    cfg, corpus = bench_config(args)
    tok = prepare_tokenizer(cfg)
    print(f"Machine: {machine()}\n")

    cache = ensure_cache(cfg, "train", tok)
    loaders = {
        "token cache": lambda: make_loader(cfg, cfg.data.train, tok, train=True, cache=cache),
        "stream": lambda: make_loader(cfg, cfg.data.train, tok, train=True),
    }

    # 1. Each pipeline alone: one pass over the split (the loader's first epoch).
    def one_pass(loader) -> tuple[float, int, int]:
        ld, tokens, batches = loader(), 0, 0
        start = time.perf_counter()
        it = iter(ld)
        for batch in it:
            if ld.epoch > 0:
                break
            tokens, batches = tokens + batch.n_tokens, batches + 1
        seconds = time.perf_counter() - start
        it.close()
        return seconds, tokens, batches

    passes = {name: [one_pass(ld) for _ in range(args.repeats)] for name, ld in loaders.items()}
    pass_tokens, pass_batches = passes["token cache"][0][1:]

    # 2 and 3. Training from memory and from the live loader, on the same batches, interleaved.
    n = args.warmup + args.steps
    trainer = AiaynTrainer(cfg, tok.vocab_size)

    def from_memory(batches: list) -> Callable[[], float]:
        timed_tokens = sum(b.n_tokens for b in batches[args.warmup :])

        def rate() -> float:
            time_steps(trainer.step, batches[: args.warmup])
            return timed_tokens / time_steps(trainer.step, batches[args.warmup :])

        return rate

    def from_loader(loader) -> Callable[[], float]:
        def rate() -> float:
            it = iter(loader())
            try:
                time_steps(trainer.step, list(itertools.islice(it, args.warmup)))
                start = time.perf_counter()
                got = 0
                for batch in itertools.islice(it, args.steps):
                    trainer.step(batch)
                    got += batch.n_tokens
                return got / (time.perf_counter() - start)
            finally:
                it.close()

        return rate

    contenders = {}
    for name, loader in loaders.items():
        contenders[f"{name} in-memory"] = from_memory(list(itertools.islice(loader(), n)))
        contenders[f"{name} live"] = from_loader(loader)
    rates = interleaved(contenders, args.repeats)

    rows = []
    for name in loaders:
        consume = summary(rates[f"{name} in-memory"])[0]
        for label, values in (
            (f"{name} alone, one pass", [t / s for s, t, _ in passes[name]]),
            ("training on its batches in memory (model consumption)", rates[f"{name} in-memory"]),
            (f"training fed by the live {name} (end to end)", rates[f"{name} live"]),
        ):
            med, lo, hi = summary(values)
            rows.append([label, fmt(med), f"{fmt(lo)} - {fmt(hi)}", f"{med / consume:.2f}x"])
    m = cfg.model
    print(
        f"### {corpus}: {pass_batches} batches, {pass_tokens} target tokens per pass (cached); "
        f"vocab {tok.vocab_size}; model {args.preset} (d_model {m.d_model}, N {m.N}); "
        f"max_tokens {cfg.train.max_tokens}, shuffle_buffer {cfg.data.shuffle_buffer}; "
        f"training: {args.steps} steps after {args.warmup} warm-up, {args.repeats} repeats "
        "interleaved\n"
    )
    header = ["what", "target tokens/s (median)", "min - max", "vs its in-memory training"]
    print(markdown_table(header, rows))
    print(
        "\nGoals: pipeline >= 10x model consumption; end to end >= 0.98x in-memory.",
        f"Threads: {torch.get_num_threads()}.",
    )


if __name__ == "__main__":
    main()
