"""Evaluation: validation loss and perplexity, translation with BLEU, classifier accuracy."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from torch import nn

from aiayn.checkpoint import CHECKPOINTS_DIR, check_architecture
from aiayn.checkpoint.init_source import load_weights, locate
from aiayn.config import Config, DecodeConfig, apply_override, config_from_dict
from aiayn.data import make_loader, open_split
from aiayn.data.batch import Batch
from aiayn.data.run_splits import copied_split
from aiayn.decode import beam_search, greedy_search
from aiayn.files import write_atomic
from aiayn.lm_eval import lm_scores, sample_text
from aiayn.loss import batch_loss, grad_free
from aiayn.metric_names import (
    ACCURACY,
    BLEU,
    BLEU_LC,
    CHRF,
    LOSS,
    PPL,
    PREFIX,
    SECONDS,
    TER,
    TRANSLATION,
)
from aiayn.model import build_model
from aiayn.tokenizer import Tokenizer, check_contract

log = logging.getLogger("aiayn")


def validation_metrics(
    model: nn.Module,
    batches: list[Batch],
    kind: str,
    pad_id: int,
    device: torch.device,
    reduce: Callable[[list[float]], list[float]] = lambda sums: sums,
    lockstep: tuple[int, Batch] | None = None,
) -> dict[str, float]:
    """Loss without label smoothing (so perplexity is the model's own), and accuracy.

    `reduce` sums the counts over data-parallel ranks, each of which holds a shard of batches.
    `lockstep` (rounds, filler), for a model whose forward is a collective (ZeRO-3's
    partitioned one): every rank runs `rounds` forwards, a rank with fewer batches the filler
    batch, whose result it drops.
    """
    was_training = model.training
    model.eval()
    loss_sum, correct, n = 0.0, 0.0, 0
    rounds, filler = lockstep or (len(batches), None)
    with grad_free(lockstep is not None):
        for i in range(rounds):
            batch = (batches[i] if i < len(batches) else filler).to(device)
            loss, right = batch_loss(model, batch, kind, 0.0, pad_id)
            if i < len(batches):
                loss_sum += float(loss)
                correct += float(right)
                n += batch.n_tokens
    model.train(was_training)
    loss_sum, correct, n = reduce([loss_sum, correct, n])
    loss = loss_sum / max(n, 1)
    result = {LOSS: loss, ACCURACY: correct / max(n, 1)}
    if kind != "classifier":
        result[PPL] = math.exp(min(loss, 50.0))
    return result


def translate(
    model: nn.Module, tok: Tokenizer, lines: list[str], cfg: DecodeConfig, device: torch.device
) -> list[str]:
    """Translate `lines` in length-sorted batches; hypotheses come back in input order."""
    decode = decoder(model, tok, cfg, device)
    return translate_batches(tok, lines, model.cfg.max_len, cfg.batch_size, decode)


def decoder(
    model: nn.Module, tok: Tokenizer, cfg: DecodeConfig, device: torch.device
) -> Callable[[list[list[int]]], list[list[int]]]:
    """A batch's source token ids (no eos) -> its hypotheses' token ids, by beam search (or
    greedy search with decode.beam 1)."""
    special = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)

    def decode(batch: list[list[int]]) -> list[list[int]]:
        rows = [ids + [tok.eos_id] for ids in batch]
        src = torch.full((len(rows), max(map(len, rows))), tok.pad_id, dtype=torch.long)
        for r, ids in enumerate(rows):
            src[r, : len(ids)] = torch.tensor(ids)
        lengths = dict(max_len_b=cfg.max_len_b, min_len=cfg.min_len)
        if cfg.beam == 1:
            return greedy_search(model, src.to(device), **lengths, **special)
        return beam_search(
            model, src.to(device), beam=cfg.beam, alpha=cfg.alpha, **lengths, **special
        )

    return decode


def translate_batches(
    tok: Tokenizer,
    lines: list[str],
    max_len: int,
    batch_size: int,
    decode: Callable[[list[list[int]]], list[list[int]]],
) -> list[str]:
    """What every engine's translation shares: each line encoded and cut to max_len - 1 tokens
    (room for eos) with a warning, batches of batch_size lines of similar length, and the text of
    each hypothesis in input order. decode maps a batch's token ids (no eos) to its hypotheses'.
    A line of no tokens is translated as an empty line, not decoded (decode.min_len would make
    it say something)."""
    encoded = encode_sources(tok, lines, max_len)
    out: list[str] = [""] * len(lines)
    for idx in length_batches(encoded, batch_size):
        idx = [i for i in idx if encoded[i]]
        if not idx:
            continue
        for i, text in zip(idx, tok.decode(decode([encoded[i] for i in idx])), strict=True):
            out[i] = text
    return out


def encode_sources(tok: Tokenizer, lines: list[str], max_len: int) -> list[list[int]]:
    """Each line's token ids, cut to max_len - 1 (room for eos), with a warning if any was."""
    max_src = max_len - 1
    encoded = tok.encode(lines)
    too_long = sum(len(ids) > max_src for ids in encoded)
    if too_long:
        log.warning(
            "%d of %d inputs are longer than model.max_len - 1 = %d tokens and were cut to fit",
            too_long,
            len(lines),
            max_src,
        )
        encoded = [ids[:max_src] for ids in encoded]
    return encoded


def length_batches(encoded: list[list[int]], batch_size: int) -> list[list[int]]:
    """The sentences' indices in batches of batch_size, by length: how one process batches
    them, and so what every rank's share is cut from (a sentence's hypothesis can depend on its
    batch's padded shape, in the last bits of a score)."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def rank_shares(batches: list[list[int]], encoded: list[list[int]], world: int) -> list[list[int]]:
    """Which batches each rank decodes (their indices, in order), balanced by cost: each
    batch, costliest first, goes to the rank with the least so far. A batch's cost is its
    rows times its longest source, which the decoding steps follow."""
    cost = [len(b) * (1 + max(len(encoded[i]) for i in b)) for b in batches]
    load, shares = [0] * world, [[] for _ in range(world)]
    for j in sorted(range(len(batches)), key=lambda j: (-cost[j], j)):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += cost[j]
        shares[rank].append(j)
    return [sorted(share) for share in shares]


class Lockstep:
    """ZeRO-3's partitioned model, decoded by every rank in step.

    Each forward of a ZeRO-3 layer gathers its parameters from every rank: all ranks must call
    the same layers in the same order. So the ranks start each batch together (an encode),
    and each decoding step is a round that every rank takes: a rank whose search has ended
    (`idle`) keeps feeding one row of its last state through the decoder, with its caches, so
    that it calls the layers the others call, until no rank has a step left (one sum per
    round). The search functions see the model (encode, decode, cfg) and nothing else."""

    partitioned = True  # decode.py: no_grad, not inference_mode (loss.grad_free)

    def __init__(self, model: nn.Module, env):
        self.model, self.env, self.cfg = model, env, model.cfg
        self._last = None  # this rank's last decoding step: a row of it to repeat when idle

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def encode(self, src: torch.Tensor):
        return self.model.encode(src)

    def parameters(self):
        return self.model.parameters()

    def decode(self, tgt, memory, src_mask, state=None, **kwargs):
        """A translation model's decoding step, in this rank's round."""
        self._round(active=True)
        self._last = (tgt[:1, -1:], memory[:1], src_mask[:1], state)
        return self.model.decode(tgt, memory, src_mask, state, **kwargs)

    def __call__(self, tokens, state=None, **kwargs):
        """A language model's step (sampling), in this rank's round."""
        self._round(active=True)
        self._last = (tokens[:1, -1:], None, None, None)
        return self.model(tokens, state=state, **kwargs)

    def idle(self) -> None:
        """After this rank's search of a batch (or its sampling): a step of a row of its last
        state while any rank still decodes. A translation model repeats a row of its own
        decoding, caches included, so that it calls the layers the others call (the
        cross-attention's key and value projections only at a sentence's first step); a
        language model calls the same layers at every step, and takes a one-token input."""
        if self._last is None:  # an lm rank that took no step (rank 0 alone samples)
            device = next(self.model.parameters()).device
            self._last = (torch.zeros(1, 1, dtype=torch.long, device=device), None, None, None)
        tgt, memory, src_mask, state = self._last
        if state is not None:
            first = torch.zeros(1, dtype=torch.long, device=tgt.device)
            state.select_sources(first)
            state.reorder(first)
        with grad_free(True):
            while self._round(active=False):
                if memory is None:
                    self.model(tgt)
                else:
                    self.model.decode(tgt, memory, src_mask, state)
        self._last = None

    def _round(self, active: bool) -> bool:
        """One round: how many ranks decode in it; True if any."""
        return self.env.sum([float(active)])[0] > 0


def translation_scores(hyps: list[str], refs: list[str], tokenize: str = "13a") -> dict[str, Any]:
    """Corpus sacreBLEU: BLEU cased and lowercased, chrF (chrF2, sacreBLEU's default) and TER,
    each with its signature, and the share of exact matches."""
    metrics = {
        BLEU: sacrebleu.metrics.BLEU(tokenize=tokenize),
        BLEU_LC: sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=True),
        CHRF: sacrebleu.metrics.CHRF(),
        TER: sacrebleu.metrics.TER(),
    }
    out: dict[str, Any] = {}
    for name, metric in metrics.items():
        out[name] = metric.corpus_score(hyps, [refs]).score
        out[f"{name}_signature"] = str(metric.get_signature())
    out["exact_match"] = sum(h.strip() == r.strip() for h, r in zip(hyps, refs, strict=True)) / max(
        len(refs), 1
    )
    return out


class Validation:
    """What each validation measures: loss, perplexity and accuracy on the validation batches
    (built once), and for translation sacreBLEU's BLEU, chrF and TER on the dev set's
    translations (the whole of it unless train.eval_bleu limits it), with a few source /
    reference / hypothesis samples for TensorBoard and every hypothesis in a file of the run.

    Every rank translates its share of the dev set: the batches one process would decode
    (length_batches), dealt out by cost (rank_shares), so that the hypotheses are those of one
    process at any world size. Rank 0 gathers them in order, scores them and writes them; the
    scores reach every rank."""

    def __init__(self, cfg: Config, tok: Tokenizer, env, prefix: str = PREFIX):
        self.cfg, self.tok = cfg, tok
        self.prefix = prefix  # TensorBoard's and the log's name: valid, or valid_<source>
        self.batches: list[Batch] = []
        self.lines: list[str] = []  # lm: the whole text, scored by lm_eval
        if cfg.model.kind == "lm":
            self.lines = split_lines(cfg, cfg.data.valid)
        else:
            loader = make_loader(
                cfg, cfg.data.valid, tok, train=False, rank=env.rank, world_size=env.world_size
            )
            limit = cfg.train.eval_batches  # None: all
            self.batches = list(itertools.islice(loader, limit))
        self.sources: list[list[int]] = []  # the dev sentences' token ids, every rank's
        self.mine: list[list[int]] = []  # this rank's batches: indices into sources
        self.pairs: list[dict] = []  # rank 0: the dev set's sources and references
        self.signatures_logged = False
        # ZeRO-3's lockstep, found at the first validation (a collective): the rounds of loss
        # batches and a filler batch, and the rounds of translation batches.
        self._fill: tuple[int, Batch] | None = None
        self._rounds: int | None = None
        if cfg.model.kind == "seq2seq" and cfg.train.eval_bleu != 0:
            source = open_split(cfg.data, cfg.data.valid, "seq2seq")
            pairs = list(itertools.islice(source, cfg.train.eval_bleu))  # None: all
            self.sources = encode_sources(tok, [p["src"] for p in pairs], cfg.model.max_len)
            batches = length_batches(self.sources, cfg.decode.batch_size)
            share = rank_shares(batches, self.sources, env.world_size)[env.rank]
            self.mine = [batches[j] for j in share]
            self.pairs = pairs if env.is_main else []

    def run(self, engine, metrics, step: int, env) -> dict[str, float]:
        """Validate; every rank must call it (the counts are summed over ranks, each rank
        translates its share)."""
        cfg, device = self.cfg, engine.device
        started = time.perf_counter()
        # ZeRO-3's partitioned model, every rank in step (Lockstep), rather than a gathered
        # copy of it on every rank. Otherwise the bare module: a DDP forward outside the
        # training step would wait for its peers.
        partitioned = engine.partitioned
        whole = contextlib.nullcontext(engine.module) if partitioned else engine.full_module()
        with whole as module, engine.autocast():
            if self.lines:
                limit = cfg.train.eval_batches
                result = score_lines(
                    module, self.tok, self.lines, cfg, device, env, limit, partitioned
                )
                if cfg.logging.samples:
                    self._lm_samples(module, partitioned, metrics, step, env)
            else:
                lockstep = self._filled(env) if partitioned else None
                result = validation_metrics(
                    module, self.batches, cfg.model.kind, self.tok.pad_id, device, env.sum, lockstep
                )
            if self.sources:
                model = Lockstep(module, env) if partitioned else module
                result.update(self._translate(model, device, metrics, step, env))
        result[SECONDS] = time.perf_counter() - started
        metrics.log(self.prefix, step, result)
        return result

    def _lm_samples(self, module, partitioned: bool, metrics, step: int, env) -> None:
        """Rank 0 samples a few texts for TensorBoard; under ZeRO-3 the others take its rounds."""
        if not partitioned:
            if env.is_main:
                metrics.text(f"{self.prefix}/samples", step, lm_samples(module, self.tok, self.cfg))
            return
        model = Lockstep(module, env)
        if env.is_main:
            metrics.text(f"{self.prefix}/samples", step, lm_samples(model, self.tok, self.cfg))
        model.idle()

    def _filled(self, env) -> tuple[int, Batch]:
        """(rounds, filler) for validation_metrics in lockstep: the most batches a rank holds,
        and a batch for the rounds past this rank's (its first; a rank with none borrows the
        split's first). The same at every validation: found at the first."""
        if self._fill is None:
            rounds = int(env.max([float(len(self.batches))])[0])
            if self.batches:
                self._fill = rounds, self.batches[0]
            else:
                cfg = self.cfg
                loader = make_loader(cfg, cfg.data.valid, self.tok, train=False)
                self._fill = rounds, next(iter(loader))
        return self._fill

    def _translate(self, model, device, metrics, step: int, env) -> dict[str, float]:
        """This rank's share of the dev set translated; the scores of all of it, on every rank.
        In lockstep every rank takes as many batches as the busiest (an empty sentence past its
        own) and waits for the others at the end of each."""
        cfg, started = self.cfg, time.perf_counter()
        decode = decoder(model, self.tok, cfg.decode, device)
        lockstep = isinstance(model, Lockstep)
        if lockstep and self._rounds is None:  # the busiest rank's batches: found once
            self._rounds = int(env.max([float(len(self.mine))])[0])
        rounds = self._rounds if lockstep else len(self.mine)
        mine = []
        for b in range(rounds):
            if b < len(self.mine):
                idx = self.mine[b]
                hyps = self.tok.decode(decode([self.sources[i] for i in idx]))
                mine.extend(zip(idx, hyps, strict=True))
            else:
                decode([[]])
            if lockstep:
                model.idle()
        busiest = env.max([time.perf_counter() - started])[0]
        parts = env.gather_to_main(mine)
        scores = None
        if env.is_main:
            hyps = [""] * len(self.sources)
            for part in parts:
                for i, text in part:
                    hyps[i] = text
            scores = self._report(hyps, metrics, step, busiest, env.world_size)
        return env.broadcast(scores)

    def _report(self, hyps: list[str], metrics, step: int, busiest: float, world: int) -> dict:
        """Rank 0: score the dev set's hypotheses, write them to the run, show a few."""
        cfg = self.cfg
        srcs, refs = [p["src"] for p in self.pairs], [p["tgt"] for p in self.pairs]
        scores = translation_scores(hyps, refs, cfg.decode.bleu_tokenize)
        path = hypotheses_path(cfg.run_dir, step, self.prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, "".join(h.replace("\n", " ") + "\n" for h in hyps))
        log.info(
            "%s step %d: %d dev sentences translated by %d rank(s), the busiest in %.1f s; "
            "hypotheses in %s",
            self.prefix,
            step,
            len(hyps),
            world,
            busiest,
            path,
        )
        if not self.signatures_logged:
            for name in TRANSLATION:
                log.info("%s %s signature: %s", self.prefix, name, scores[f"{name}_signature"])
            self.signatures_logged = True
        samples = zip(srcs[: cfg.logging.samples], refs, hyps, strict=False)
        text = "\n\n".join(
            f"**source:** {s}  \n**reference:** {r}  \n**hypothesis:** {h}" for s, r, h in samples
        )
        metrics.text(f"{self.prefix}/samples", step, text)
        return {name: scores[name] for name in TRANSLATION}


def hypotheses_path(run_dir: str | Path, step: int, prefix: str = PREFIX) -> Path:
    """Where a validation writes the dev set's hypotheses, a line per sentence, in order (a
    source's own dev set: in valid_<source>)."""
    return Path(run_dir) / prefix / f"step_{step:08d}.hyp"


def split_lines(cfg: Config, spec: str) -> list[str]:
    """Every line of an lm's split, empty ones included: the text that is scored."""
    return [rec["text"] for rec in open_split(cfg.data, spec, "lm")]


def score_lines(
    model: nn.Module,
    tok: Tokenizer,
    lines: list[str],
    cfg: Config,
    device,
    env=None,
    max_batches: int | None = None,
    lockstep: bool = False,
) -> dict[str, float]:
    """lm_eval's scores of `lines` with the run's window, stride, unit and batch size; with a
    DistEnv, each rank scores its share of the windows and the sums are combined (`lockstep`:
    every rank runs as many forwards as the busiest, for ZeRO-3's partitioned model)."""
    window = cfg.data.max_len
    rows = max(1, cfg.train.max_tokens // window)
    return lm_scores(
        model,
        tok,
        lines,
        window=window,
        stride=cfg.train.eval_stride,
        unit=cfg.data.unit,
        device=device,
        rows=rows,
        rank=env.rank if env else 0,
        world_size=env.world_size if env else 1,
        reduce=env.sum if env else lambda sums: sums,
        max_windows=None if max_batches is None else max_batches * rows,
        rounds=(lambda n: int(env.max([float(n)])[0])) if lockstep else None,
    )


def lm_samples(model: nn.Module, tok: Tokenizer, cfg: Config) -> str:
    """Markdown of logging.samples texts sampled from nothing, for TensorBoard."""
    texts = sample_text(
        model,
        tok,
        [""] * cfg.logging.samples,
        max_new_tokens=cfg.data.max_len,
        seed=cfg.train.seed,
        running_text=cfg.data.lm_order == "stream",
    )
    # Markdown: four leading spaces keep each sample's line breaks.
    return "\n\n---\n\n".join("    " + t.replace("\n", "\n    ") for t in texts)


def load_for_inference(
    checkpoint: str | Path, overrides: list[str] = (), device: str | torch.device = "auto"
) -> tuple[Config, nn.Module, Tokenizer, Path]:
    """Rebuild a model from a checkpoint's own config (plus overrides) and load its weights.

    `checkpoint`: a run_dir (its latest valid checkpoint), a step or averaged checkpoint
    directory, or a FILE.safetensors written by `aiayn export`.
    """
    from aiayn.distributed.env import pick_device

    found = locate(checkpoint)
    raw, where, ckpt = copy.deepcopy(found.config), found.where, found.checkpoint
    for item in overrides:
        apply_override(raw, item)
    cfg = config_from_dict(raw, source=where)
    tok_path = found.tokenizer
    if tok_path is None or any(o.startswith("tokenizer.path=") for o in overrides):
        tok_path = cfg.tokenizer_path
    tok = Tokenizer(tok_path)
    check_contract(found.contract, tok, where=where)
    check_architecture(found.config["model"], dataclasses.asdict(cfg.model), where)
    model = build_model(cfg.model, tok.vocab_size, tok.pad_id)
    load_weights(model, found)
    model.to(device if isinstance(device, torch.device) else pick_device(device)).eval()
    return cfg, model, tok, ckpt


def evaluate(checkpoint: str | Path, split: str = "test", overrides: list[str] = ()) -> dict:
    """Score a checkpoint on a data split: BLEU (seq2seq), perplexity (lm), accuracy."""
    cfg, model, tok, ckpt = load_for_inference(checkpoint, overrides, "auto")
    device = next(model.parameters()).device
    # A training run's checkpoint (or its averaged model, RUN/averaged): the run may hold a
    # copy of the split.
    run_dir = ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS_DIR else ckpt.parent
    if (run_dir / CHECKPOINTS_DIR).is_dir():
        cfg = copied_split(cfg, split, run_dir) or cfg
    spec = getattr(cfg.data, split, None)
    if spec is None:
        from aiayn.errors import ConfigError

        raise ConfigError(f"data.{split} is not set in the run's config; pass data.{split}=...")
    kind = cfg.model.kind
    if kind == "seq2seq":
        pairs = list(open_split(cfg.data, spec, kind))
        srcs, refs = [p["src"] for p in pairs], [p["tgt"] for p in pairs]
        hyps = translate(model, tok, srcs, cfg.decode, device)
        result: dict[str, Any] = translation_scores(hyps, refs, cfg.decode.bleu_tokenize)
        result["samples"] = list(zip(srcs[:5], refs[:5], hyps[:5], strict=True))
        out = Path(cfg.run_dir) / "eval" / f"{split}.{ckpt.name}.hyp"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(h + "\n" for h in hyps))
        result["hypotheses_file"] = str(out)
    elif kind == "lm":
        result = score_lines(model, tok, split_lines(cfg, spec), cfg, device)
        result["window"] = cfg.data.max_len
        result["stride"] = cfg.train.eval_stride or cfg.data.max_len
    else:
        loader = make_loader(cfg, spec, tok, train=False)
        result = validation_metrics(model, list(loader), kind, tok.pad_id, device)
    result["checkpoint"] = str(ckpt)
    result["split"] = split
    return result
