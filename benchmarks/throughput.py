"""Training throughput of aiayn against PyTorch's nn.Transformer and Hugging Face MarianMT.

    python benchmarks/throughput.py                 # small and transformer_base, ~15 min on 2 cores
    python benchmarks/throughput.py --quick         # small only, fewer steps: a smoke test

All trainers get the same model dimensions (a model preset), the same vocabulary, the same
padded batches of similar-length sentences, the same thread count, label-smoothed
cross-entropy and Adam. Warm-up steps are excluded; each repeat times every trainer once, in
rotated order, and the table gives the median, min and max over repeats of target tokens/s
(non-pad tokens of tgt_out). Achieved GFLOP/s counts the matrix multiplies of forward and
backward that each trainer executes (aiayn.train.flops.training_flops; the peers also project their
padding to the vocabulary, which aiayn skips) and is shown as a fraction of an fp32 2048^3
matrix-multiply peak measured in the same run.

Each trainer runs in a process of its own, as it would for a user, with the allocator policy of
its own entry point: aiayn keeps freed host memory (train.malloc: keep,
aiayn/runtime/malloc.py), the peers run with glibc's default. Two more rows swap the policies
(aiayn with glibc's default, MarianMT with aiayn's), so the table shows both the comparison a
user sees and the like-for-like one; the last column compares every row with MarianMT given
aiayn's policy. `--no-malloc-rows` leaves those two out (fewer processes: each holds its own model).

The peers are optional (`pip install .[bench]`); a missing one gives a "skipped" row.
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing as mp
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from _common import (
    AiaynTrainer,
    fmt,
    machine,
    markdown_table,
    rotated,
    run_config,
    set_threads,
    summary,
    time_steps,
)
from torch import nn

from aiayn.config import ModelConfig
from aiayn.data.batch import Batch
from aiayn.data.pad import Specials, one_batch, table
from aiayn.data.plan import budget_bounds
from aiayn.runtime.malloc import keep_freed_memory
from aiayn.tokenizer import BOS_ID as BOS
from aiayn.tokenizer import EOS_ID as EOS
from aiayn.tokenizer import PAD_ID as PAD
from aiayn.tokenizer import UNK_ID
from aiayn.train.flops import measure_matmul_peak, training_flops

FIRST_PIECE = max(PAD, UNK_ID, BOS, EOS) + 1  # the first id that is not a special token

# ---- the batches --------------------------------------------------------------------------


def synthetic_batches(
    n_batches: int, max_tokens: int, vocab: int, seed: int = 0, mean_len: float = 14.0
) -> list[Batch]:
    """Padded batches as aiayn's loader makes them: sentences sorted by length and cut by the
    loader's own token-budget rule (data/plan.py), rows built by its own padding
    (data/batch.py), then shuffled. Lengths are log-normal around mean_len tokens (Multi30k
    with an 8k joint BPE: ~13 source, ~14 target tokens, long tail to ~40); token ids are
    uniform (their values do not change the work)."""
    rng = np.random.default_rng(seed)
    n = max(4 * n_batches * max_tokens // int(mean_len), 1000)
    tgt_len = np.clip(np.round(rng.lognormal(math.log(mean_len), 0.35, n)), 2, 100).astype(int)
    src_len = np.clip(np.round(tgt_len * rng.lognormal(0.0, 0.15, n)), 2, 100).astype(int)
    width = np.maximum(src_len, tgt_len) + 1
    order = np.argsort(width, kind="stable")
    bounds = budget_bounds(width[order], max_tokens).tolist()
    groups = [order[a:b] for a, b in itertools.pairwise(bounds)]
    picks = rng.permutation(len(groups))[:n_batches]
    return [_batch(src_len[groups[k]], tgt_len[groups[k]], vocab, rng) for k in picks]


def _batch(src_len: np.ndarray, tgt_len: np.ndarray, vocab: int, rng) -> Batch:
    def rows(lengths: np.ndarray) -> list[np.ndarray]:
        flat = rng.integers(FIRST_PIECE, vocab, int(lengths.sum()))
        return np.split(flat, np.cumsum(lengths)[:-1])

    src, tgt = rows(src_len), rows(tgt_len)
    widest = int(max(src_len.max(), tgt_len.max())) + 1
    return one_batch(
        [table(src, tgt, np.arange(len(src_len)))],
        np.arange(len(src_len)),
        Specials(PAD, BOS, EOS, multiple=1, limit=widest),
    )


# ---- the peers ----------------------------------------------------------------------------


def _smoothed_ce(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        target.reshape(-1),
        ignore_index=PAD,
        label_smoothing=smoothing,
        reduction="sum",
    )


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    # torch's defaults, as a minimal loop would write it; the paper's betas and epsilon (§5.3).
    return torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)


class _TorchSeq2Seq(nn.Module):
    """nn.Transformer with shared, scaled embeddings, sinusoidal positions and a tied output."""

    def __init__(self, m: ModelConfig, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, m.d_model, padding_idx=PAD)
        pos = torch.arange(m.max_len)[:, None]
        inv = torch.exp(torch.arange(0, m.d_model, 2) * (-math.log(10000.0) / m.d_model))
        pe = torch.zeros(m.max_len, m.d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * inv), torch.cos(pos * inv)
        self.register_buffer("pe", pe)
        self.dropout = nn.Dropout(m.dropout)
        self.transformer = nn.Transformer(
            m.d_model, m.h, m.N, m.N, m.d_ff, m.dropout, batch_first=True
        )
        self.out = nn.Linear(m.d_model, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.scale = math.sqrt(m.d_model)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embed(x) * self.scale + self.pe[: x.size(1)])

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        src_pad = src == PAD
        # Right-padded targets need no key padding mask: the causal mask hides trailing pads.
        y = self.transformer(
            self._embed(src),
            self._embed(tgt),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return self.out(y)


class TorchTrainer:
    name = "nn.Transformer"

    def __init__(self, m: ModelConfig, vocab: int, smoothing: float):
        torch.manual_seed(0)
        self.model, self.smoothing = _TorchSeq2Seq(m, vocab), smoothing
        self.opt = _adam(self.model)

    def step(self, batch: Batch) -> None:
        self.model.train()
        logits = self.model(batch.src, batch.tgt_in)
        loss = _smoothed_ce(logits, batch.tgt_out, self.smoothing) / batch.n_tokens
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class MarianTrainer:
    """transformers' MarianMTModel (the paper's post-LN architecture) from a config, untrained."""

    name = "HF MarianMT"

    def __init__(self, m: ModelConfig, vocab: int, smoothing: float):
        from transformers import MarianConfig, MarianMTModel

        config = MarianConfig(
            vocab_size=vocab,
            d_model=m.d_model,
            encoder_layers=m.N,
            decoder_layers=m.N,
            encoder_attention_heads=m.h,
            decoder_attention_heads=m.h,
            encoder_ffn_dim=m.d_ff,
            decoder_ffn_dim=m.d_ff,
            activation_function="relu",
            dropout=m.dropout,
            attention_dropout=0.0,
            activation_dropout=0.0,
            max_position_embeddings=m.max_len,
            scale_embedding=True,
            share_encoder_decoder_embeddings=True,
            pad_token_id=PAD,
            eos_token_id=EOS,
            decoder_start_token_id=BOS,
        )
        torch.manual_seed(0)
        self.model = MarianMTModel(config)
        self.smoothing = smoothing
        self.opt = _adam(self.model)

    def step(self, batch: Batch) -> None:
        self.model.train()
        logits = self.model(
            input_ids=batch.src,
            attention_mask=(batch.src != PAD).long(),
            decoder_input_ids=batch.tgt_in,
        ).logits
        loss = _smoothed_ce(logits, batch.tgt_out, self.smoothing) / batch.n_tokens
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


PEERS = {"nn.Transformer": TorchTrainer, "HF MarianMT": MarianTrainer}


class MatmulsAlone:
    """The matrix multiplies of aiayn's step on a batch, replayed on their own: the time a
    trainer doing the same fp32 FLOPs would take if everything else (attention, softmax, norms,
    dropout, the optimizer) cost nothing. Shapes come from profiling one real step per batch;
    operands are contiguous, so transposed layouts are not reproduced."""

    name = "matmuls alone (ceiling)"

    def __init__(self, aiayn: AiaynTrainer, batches: list[Batch]):
        from torch.profiler import ProfilerActivity, profile

        gen = torch.Generator().manual_seed(0)
        operands: dict[tuple, torch.Tensor] = {}  # one tensor per shape, shared by the calls

        def operand(*shape: int) -> torch.Tensor:
            if shape not in operands:
                operands[shape] = torch.randn(*shape, generator=gen)
            return operands[shape]

        self.calls: dict[int, list[tuple]] = {}
        for batch in batches:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                aiayn.step(batch)
            calls = []
            for e in prof.events():
                if e.name == "aten::mm":
                    (m, k), (_, n) = e.input_shapes[:2]
                    calls.append((None, operand(m, k), operand(k, n)))
                elif e.name == "aten::addmm":
                    _, (m, k), (_, n) = e.input_shapes[:3]
                    calls.append((operand(n), operand(m, k), operand(k, n)))
            self.calls[id(batch)] = calls

    def step(self, batch: Batch) -> None:
        for bias, a, b in self.calls[id(batch)]:
            torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


# ---- one process per contender ------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    row: str  # its row in the table
    trainer: str  # "aiayn" or a key of PEERS
    malloc: str  # "keep" (what `aiayn train` sets on CPU) or "system" (glibc's default)
    compile: bool = False


CEILING = MatmulsAlone.name  # served by aiayn's own process: it replays aiayn's shapes


def contenders(args) -> list[Contender]:
    """aiayn as `aiayn train` runs it and the peers as a minimal loop runs them, each with the
    allocator policy of its own entry point; then each with the other's policy, which shows
    what the allocator alone is worth."""
    rows = [Contender("aiayn", "aiayn", "keep")]
    if args.compile:
        # train.compile; off by default: on this CPU it made training slower.
        rows.append(Contender("aiayn + torch.compile", "aiayn", "keep", compile=True))
    rows += [Contender(name, name, "system") for name in PEERS]
    if not args.no_malloc_rows:
        rows += [
            Contender("aiayn, malloc system", "aiayn", "system"),
            Contender("HF MarianMT, malloc keep", "HF MarianMT", "keep"),
        ]
    return rows


def _serve(conn, c: Contender, preset: str, args) -> None:
    """A contender's process: its allocator policy first (it applies to later allocations),
    then its trainer; then it trains on the batches it is told, one step per message, and
    answers with the seconds each took. It makes the same batches as every other process."""
    try:
        if c.malloc == "keep":
            keep_freed_memory()
        set_threads(args.threads)
        cfg = run_config(preset, max_tokens=args.max_tokens, seed=1, compile=c.compile)
        batches = synthetic_batches(args.batches + args.warmup, args.max_tokens, args.vocab)
        if c.trainer == "aiayn":
            trainer = AiaynTrainer(cfg, args.vocab, name=c.row)
            n_params = sum(p.numel() for p in trainer.engine.module.parameters())
        else:
            trainer = PEERS[c.trainer](cfg.model, args.vocab, cfg.train.label_smoothing)
            n_params = sum(p.numel() for p in trainer.model.parameters())
    except ImportError as exc:
        conn.send(("skipped", f"{exc}"))
        return
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", n_params))
    steps = {"step": trainer.step}
    while (msg := conn.recv())[0] != "stop":
        what, i = msg
        try:
            if what == CEILING and CEILING not in steps:
                steps[CEILING] = MatmulsAlone(trainer, batches[args.warmup :]).step
                time_steps(steps[CEILING], batches[args.warmup : args.warmup + 1])  # warm-up
            conn.send(("ok", time_steps(steps[what], [batches[i]])))
        except Exception:
            conn.send(("error", traceback.format_exc()))
            return


class Process:
    """The main process's handle on one contender's process."""

    def __init__(self, c: Contender, preset: str, args):
        ctx = mp.get_context("spawn")  # a fresh interpreter: glibc's own policy until told
        self.contender = c
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, c, preset, args), daemon=True)
        self.proc.start()
        child.close()
        self.status, self.detail = self._recv()

    def _recv(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(
                f"{self.contender.row}: its process died (exit code {self.proc.exitcode}); "
                "out of memory? --no-malloc-rows runs fewer processes"
            ) from None

    def seconds(self, what: str, i: int) -> float:
        self.conn.send((what, i))
        status, value = self._recv()
        if status != "ok":
            raise RuntimeError(f"{self.contender.row} failed:\n{value}")
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", None))
        self.proc.join(30)


# ---- the run ------------------------------------------------------------------------------


def bench_preset(preset: str, args, peak: list[float]) -> str:
    """The table of one preset: every trainer in its own process, timed step by step."""
    batches = synthetic_batches(args.batches + args.warmup, args.max_tokens, args.vocab)
    timed = range(args.warmup, len(batches))
    procs, skipped = start_trainers(preset, args)
    try:
        calls = {row: (proc, "step") for row, proc in procs.items()}
        if not args.no_ceiling:
            calls[CEILING] = (procs["aiayn"], CEILING)
        seconds = time_interleaved(calls, timed, args.repeats, peak)
    finally:
        for proc in procs.values():
            proc.stop()
    return results_table(preset, args, batches, timed, procs, skipped, seconds, max(peak))


def start_trainers(preset: str, args) -> tuple[dict[str, Process], list[list[str]]]:
    """One process per trainer, warmed up; the rows of trainers that are not installed."""
    procs: dict[str, Process] = {}  # row -> process; started one by one, all kept alive
    skipped: list[list[str]] = []
    try:
        for c in contenders(args):
            proc = Process(c, preset, args)
            if proc.status == "skipped":
                skipped.append([c.row, f"skipped: pip install .[bench] ({proc.detail})"])
                proc.stop()
                continue
            if proc.status == "error":
                raise RuntimeError(f"{c.row} failed to start:\n{proc.detail}")
            procs[c.row] = proc
            for i in range(args.warmup):
                proc.seconds("step", i)
    except BaseException:
        for proc in procs.values():
            proc.stop()
        raise
    return procs, skipped


def time_interleaved(calls: dict, timed: range, repeats: int, peak: list[float]) -> dict:
    """Seconds per repeat of each call over the timed batches, interleaved step by step in
    rotated order: a slow phase of a busy machine then falls on all of them alike, and each
    repeat gives paired timings. One process runs at a time; the others wait on their pipes.
    The matmul peak is measured after each repeat."""
    names = list(calls)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        spent = dict.fromkeys(names, 0.0)
        for j, i in enumerate(timed):
            for n in rotated(names, r * len(timed) + j):
                proc, what = calls[n]
                spent[n] += proc.seconds(what, i)
        for n in names:
            seconds[n].append(spent[n])
        peak.append(measure_matmul_peak(torch.device("cpu"), torch.float32))
    return seconds


def results_table(preset, args, batches, timed, procs, skipped, seconds, best_peak) -> str:
    """Tokens/s, GFLOP/s and the ratios against the peers, as markdown with its title."""
    m, vocab = run_config(preset, max_tokens=args.max_tokens, seed=1).model, args.vocab
    tokens = sum(batches[i].n_tokens for i in timed)
    flops = sum(training_flops(m, vocab, batches[i]) for i in timed)
    # The peers run the output projection on every padded target position too.
    pad_rows = sum(batches[i].tgt_out.numel() - batches[i].n_tokens for i in timed)
    peer_flops = flops + 3 * 2 * pad_rows * m.d_model * vocab
    n_params = procs["aiayn"].detail

    def faster(rows: list[str], r: int) -> float:
        return min(seconds[n][r] for n in rows)

    # The peers as their users run them (glibc's default allocator), and MarianMT given the
    # allocator policy aiayn sets for itself.
    def rows_of(trainers, malloc: str) -> list[str]:
        return [
            n
            for n, p in procs.items()
            if p.contender.trainer in trainers and p.contender.malloc == malloc
        ]

    peers, same = rows_of(PEERS, "system"), rows_of(("HF MarianMT",), "keep")
    rows = []
    for name, secs in seconds.items():
        med, lo, hi = summary([tokens / s for s in secs])
        is_peer = name in procs and procs[name].contender.trainer in PEERS
        gflops = (peer_flops if is_peer else flops) / summary(secs)[0] / 1e9
        ratios = []
        for against in (peers, same):  # per repeat against the faster of that repeat, median
            vs = [faster(against, r) / s for r, s in enumerate(secs)] if against else []
            ratios.append(f"{summary(vs)[0]:.2f}x" if vs else "n/a")
        malloc = procs[name].contender.malloc if name in procs else "keep"
        rows.append(
            [
                name,
                malloc,
                fmt(med),
                f"{fmt(lo)} - {fmt(hi)}",
                fmt(gflops, 1),
                f"{100 * gflops * 1e9 / best_peak:.0f}%",
                *ratios,
            ]
        )
    rows += [[name, "", why, "", "", "", "", ""] for name, why in skipped]
    title = (
        f"### {preset}: d_model {m.d_model}, d_ff {m.d_ff}, h {m.h}, N {m.N}+{m.N}, vocab "
        f"{vocab}, {n_params / 1e6:.1f}M parameters\n\n"
        f"{len(timed)} batches of <= {args.max_tokens} tokens ({tokens} target tokens, "
        f"{flops / len(timed) / 1e9:.1f} GFLOP per step for aiayn, "
        f"{peer_flops / len(timed) / 1e9:.1f} for the peers) x {args.repeats} repeats after "
        f"{args.warmup} warm-up steps; one process per trainer; matmul peak "
        f"{best_peak / 1e9:.0f} GFLOP/s (fp32 2048^3, best of the run)\n"
    )
    header = [
        "trainer",
        "malloc",
        "target tokens/s (median)",
        "min - max",
        "GFLOP/s",
        "of peak",
        "vs faster peer",
        "vs MarianMT, malloc keep",
    ]
    return title + "\n" + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["small", "transformer_base"])
    p.add_argument("--vocab", type=int, default=8000, help="joint vocabulary size")
    p.add_argument(
        "--max-tokens", type=int, default=4096, help="tokens per batch, padding included"
    )
    p.add_argument("--batches", type=int, default=4, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per trainer")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time aiayn with train.compile (compiling takes minutes)",
    )
    p.add_argument("--no-ceiling", action="store_true", help="leave out the 'matmuls alone' row")
    p.add_argument(
        "--no-malloc-rows",
        action="store_true",
        help="leave out aiayn with glibc's default allocator and MarianMT with aiayn's",
    )
    p.add_argument("--quick", action="store_true", help="small only, 2 batches x 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.presets, args.batches, args.repeats, args.warmup = ["small"], 2, 3, 1
    set_threads(args.threads)
    keep_freed_memory()  # for the peak measured here between repeats
    print(f"Machine: {machine()}\n")
    peak: list[float] = [measure_matmul_peak(torch.device("cpu"), torch.float32)]
    for preset in args.presets:
        print(bench_preset(preset, args, peak), "\n", flush=True)


if __name__ == "__main__":
    main()
