"""Validation during training: loss, perplexity and accuracy on the dev batches, and for
translation BLEU, chrF and TER on the whole dev set, each rank decoding its share; an lm's
whole dev text scored in windows, with samples for TensorBoard."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from pathlib import Path

from torch import nn

from aiayn.config import Config
from aiayn.data import make_loader, open_split
from aiayn.data.batch import Batch
from aiayn.eval.scores import score_lines, split_lines, translation_scores, validation_metrics
from aiayn.infer.generate import sample_text
from aiayn.infer.lockstep import Lockstep
from aiayn.infer.translate import decoder, encode_sources, length_batches, rank_shares
from aiayn.metric_names import PREFIX, SECONDS, TRANSLATION
from aiayn.runtime.durable import write_atomic
from aiayn.tokenizer import Tokenizer

log = logging.getLogger("aiayn")


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
        self.lines: list[str] = []  # lm: the whole text, scored by eval/lm_scores.py
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
        decode = decoder(model, self.tok, cfg.decode, device, scored=False)
        lockstep = isinstance(model, Lockstep)
        if lockstep and self._rounds is None:  # the busiest rank's batches: found once
            self._rounds = int(env.max([float(len(self.mine))])[0])
        rounds = self._rounds if lockstep else len(self.mine)
        mine = []
        for b in range(rounds):
            if b < len(self.mine):
                idx = self.mine[b]
                best = [h[0].ids for h in decode([self.sources[i] for i in idx], idx)]
                hyps = self.tok.decode(best)
                mine.extend(zip(idx, hyps, strict=True))
            else:
                decode([[]], [0])
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
