"""Running a CTranslate2 export (ct2.py) the way aiayn runs a checkpoint:
`aiayn translate|generate|evaluate --engine ctranslate2 --checkpoint DIR`.

The same tokenizer (the export's spm.model, checked against the contract it recorded), the same
decode settings (the run's config recorded in aiayn.json, plus overrides such as decode.beam=1),
the same batching (inputs sorted by length, decode.batch_size sentences at a time) and the same
special tokens: CTranslate2 appends eos to a source and starts a target with bos itself
(config.json); a language model's prompt is read by infer.generate.prompt_ids, as the torch engine
reads it. Greedy output equals the torch engine's token for token
(tests/unit/test_export_ct2.py). Two things differ:

- Beam search ranks hypotheses by log P / len^alpha in CTranslate2, by log P /
  ((5 + len) / 6)^alpha (GNMT) in aiayn, with the same decode.alpha: beam outputs can differ.
- Translation keeps aiayn's limits, so that the output is the same: a source is cut to
  model.max_len - 1 tokens (+ eos) and a hypothesis stops at model.max_len - 1 tokens, although
  a sinusoidal export's table has at least 1024 rows (for callers of CTranslate2 itself, whose
  limits are their own). Generation may go on up to the export's max_positions (aiayn.json),
  where the torch engine stops at model.max_len.

n-best lists (decode.n_best, CTranslate2's num_hypotheses) carry CTranslate2's scores: log P /
len^alpha, of a softmax that leaves pad and bos out (suppress_sequences) where aiayn bans them
after its softmax, so they are higher by that mass and near-ties can swap. Sampling
(decode.sampling) draws from CTranslate2's generator, seeded once: not aiayn's samples.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from aiayn.config import Config, apply_override, config_from_dict
from aiayn.errors import ExportError
from aiayn.export.ct2 import FORMAT, METADATA_FILE, require_ctranslate2
from aiayn.tokenizer import Tokenizer, check_contract

log = logging.getLogger("aiayn")

ENGINES = ("torch", "ctranslate2")


def is_ct2_export(path: str | Path) -> bool:
    return (Path(path) / METADATA_FILE).is_file() and (Path(path) / "model.bin").is_file()


def check_engine(checkpoint: str | Path, engine: str) -> None:
    """ExportError if `checkpoint` is not for `engine`: a CTranslate2 export runs only with
    --engine ctranslate2, and a checkpoint only with --engine torch."""
    if engine == "ctranslate2" and not is_ct2_export(checkpoint):
        raise ExportError(
            f"{checkpoint} is not a CTranslate2 export (no {METADATA_FILE} and model.bin): "
            f"write one with `aiayn export {checkpoint} --format ctranslate2 --output DIR` and "
            "pass --checkpoint DIR, or run this checkpoint with --engine torch"
        )
    if engine == "torch" and is_ct2_export(checkpoint):
        raise ExportError(
            f"{checkpoint} is a CTranslate2 export: run it with --engine ctranslate2, or pass "
            "the checkpoint it was exported from"
        )


class Ct2Model:
    """An opened export: the run's config (with overrides), its tokenizer, and CTranslate2's
    Translator (seq2seq) or Generator (lm) on `device` with `threads` CPU threads (None: every
    core this process may use, as torch does)."""

    def __init__(
        self,
        model_dir: str | Path,
        overrides: list[str] = (),
        device: str = "auto",
        threads: int | None = None,
    ):
        ct2 = require_ctranslate2()
        self.path = Path(model_dir)
        check_engine(self.path, "ctranslate2")
        self.meta: dict[str, Any] = json.loads((self.path / METADATA_FILE).read_text())
        if self.meta.get("format") != FORMAT:
            raise ExportError(
                f"{self.path / METADATA_FILE} is not an aiayn CTranslate2 export's metadata; "
                "export the checkpoint again with `aiayn export ... --format ctranslate2`"
            )
        raw = self.meta["config"]
        for item in overrides:
            apply_override(raw, item)
        self.cfg: Config = config_from_dict(raw, source=str(self.path / METADATA_FILE))
        self.tok = Tokenizer(self.path / self.meta["tokenizer_file"])
        check_contract(self.meta["tokenizer"], self.tok, where=str(self.path))
        self.kind: str = self.meta["kind"]
        self.max_positions: int = self.meta["max_positions"]
        if device == "auto":
            device = "cuda" if ct2.get_cuda_device_count() > 0 else "cpu"
        threads = threads or _usable_cores()
        engine = ct2.Translator if self.kind == "seq2seq" else ct2.Generator
        self.engine = engine(str(self.path), device=device, intra_threads=threads)
        if self.kind == "seq2seq" and self.cfg.decode.beam > 1:
            log.warning(
                "CTranslate2 ranks beam hypotheses by log P / len^%g, aiayn by log P / "
                "((5 + len) / 6)^%g: beam outputs can differ from `aiayn translate` "
                "(decode.beam=1, greedy, gives the same output)",
                self.cfg.decode.alpha,
                self.cfg.decode.alpha,
            )

    def pieces(self, rows: list[list[int]]) -> list[list[str]]:
        """CTranslate2 takes tokens as strings: the pieces of the vocabulary it was given."""
        return [[self.tok.id_to_piece(i) for i in row] for row in rows]

    def ids(self, rows: list[list[str]]) -> list[list[int]]:
        return [[self.tok.piece_to_id(p) for p in row] for row in rows]


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _open(model: Ct2Model | str | Path, overrides, device, threads, kind: str) -> Ct2Model:
    model = model if isinstance(model, Ct2Model) else Ct2Model(model, overrides, device, threads)
    if model.kind != kind:
        what = "translate (a seq2seq model)" if kind == "seq2seq" else "generate (an lm)"
        raise ExportError(f"{model.path} is a {model.kind} export; {what} needs a {kind} export")
    return model


def translate_ct2(
    model: Ct2Model | str | Path,
    lines: list[str],
    overrides: list[str] = (),
    *,
    device: str = "auto",
    threads: int | None = None,
    n_best: bool = False,
) -> list[str] | list[list[tuple[str, float]]]:
    """Translate `lines` with a CTranslate2 export (a directory, or a Ct2Model opened once for
    many calls): length-sorted batches of decode.batch_size; hypotheses in input order; with
    `n_best`, each line's decode.n_best (text, score) hypotheses, as
    infer.translate.translate_n_best gives them (CTranslate2's score: log P / len^alpha).

    Each hypothesis stops, as aiayn's does, at its source length (+ eos) + decode.max_len_b
    tokens, and at model.max_len - 1. CTranslate2 takes one length limit per batch, so
    the batch decodes to its longest limit and each hypothesis is cut to its own: exact for
    greedy search, where a prefix does not depend on how far decoding goes on."""
    from aiayn.infer.decode import Hypothesis
    from aiayn.infer.translate import noiser, translate_batches

    model = _open(model, overrides, device, threads, "seq2seq")
    dec = model.cfg.decode
    # aiayn.infer.translate.translate's limits, whatever the export's table allows: the same output.
    max_len = min(model.max_positions, model.cfg.model.max_len)
    tok = model.tok
    banned = [[tok.id_to_piece(i)] for i in (tok.pad_id, tok.bos_id)]  # as aiayn.infer.decode

    sampling = dec.sampling
    if sampling.enabled:  # CTranslate2 samples with its own generator, seeded once
        require_ctranslate2().set_random_seed(sampling.seed)
    search = (
        dict(
            beam_size=1,
            sampling_topk=sampling.top_k,  # 0: the whole vocabulary, as decode.sampling
            sampling_topp=sampling.top_p,
            sampling_temperature=sampling.temperature,
        )
        if sampling.enabled
        else dict(beam_size=dec.beam)
    )

    def decode(batch: list[list[int]], index: list[int]) -> list[list[Hypothesis]]:
        limits = [min(len(ids) + 1 + dec.max_len_b, max_len - 1) for ids in batch]
        results = model.engine.translate_batch(
            model.pieces(batch),
            num_hypotheses=dec.n_best,
            return_scores=True,
            length_penalty=dec.alpha,  # its scores' too: log P / len^alpha
            max_decoding_length=max(limits),
            min_decoding_length=dec.min_len,
            max_input_length=0,  # cut by translate_batches, with a warning, not silently at 1024
            suppress_sequences=banned,
            **search,
        )
        return [
            [
                Hypothesis(score, ids[:limit])
                for score, ids in zip(r.scores, model.ids(r.hypotheses), strict=True)
            ]
            for r, limit in zip(results, limits, strict=True)
        ]

    hyps = translate_batches(model.tok, lines, max_len, dec.batch_size, decode, noiser(dec))
    return hyps if n_best else [h[0][0] for h in hyps]


def generate_ct2(
    model: Ct2Model | str | Path,
    prompts: list[str],
    overrides: list[str] = (),
    *,
    max_new_tokens: int = 50,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    device: str = "auto",
    threads: int | None = None,
) -> list[str]:
    """infer.generate.sample_text with a CTranslate2 export: the same prompts (each after an
    eos), the same texts back, and with data.lm_order stream the same running text in rounds of
    model.max_len positions. temperature 0 is greedy (CTranslate2's sampling_topk=1), which
    equals the torch engine's output; sampling draws from CTranslate2's own generator
    (seeded), so a sample differs from the torch engine's with the same seed."""
    model = _open(model, overrides, device, threads, "lm")
    from aiayn.infer.generate import continue_texts

    require_ctranslate2().set_random_seed(seed)
    greedy = temperature == 0
    sampling = dict(
        sampling_topk=1 if greedy else (top_k or 0),  # 0: the whole vocabulary
        sampling_temperature=1.0 if greedy else temperature,
    )
    eos = model.tok.id_to_piece(model.tok.eos_id)

    def step(context: list[list[int]], n: int, eos_id: int | None) -> list[list[int]]:
        longest = max(map(len, context))
        if longest + n - 1 > model.max_positions:  # the last new token is never fed back
            raise ExportError(
                f"a prompt of {longest} tokens and {n} new ones need {longest + n - 1} "
                f"positions; {model.path} has {model.max_positions}: lower --max-new-tokens "
                "or shorten the prompt"
            )
        # CTranslate2 counts max_length from the second prompt token on, and returns the
        # prompt with the continuation: the longest prompt gets n new tokens, and each row
        # is cut to its own n.
        results = model.engine.generate_batch(
            model.pieces(context),
            max_length=longest - 1 + n,
            end_token=eos if eos_id is not None else [],  # []: eos is an ordinary token
            max_batch_size=model.cfg.decode.batch_size,
            **sampling,
        )
        return [r.sequences_ids[0][len(row) :][:n] for r, row in zip(results, context, strict=True)]

    running_text = model.cfg.data.lm_order == "stream"
    return continue_texts(
        model.tok,
        prompts,
        step,
        max_new_tokens,
        running_text=running_text,
        window=model.cfg.model.max_len,
    )
