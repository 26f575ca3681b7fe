"""SentencePiece tokenizer: train, load, encode, decode, and the contract a run records.

One joint source+target vocabulary (§3.4 shares it between the languages, which lets the model
tie its embeddings); an imported Marian model brings two models and one table instead
(aiayn.tokenizer.marian). The special ids are fixed so that every model and every data path agrees
on them without reading the tokenizer: pad 0, unk 1, bos 2, eos 3.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from aiayn.config import TokenizerConfig
from aiayn.errors import TokenizerError
from aiayn.tokenizer import marian

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# SentencePiece stores num_threads inside the model file, so a thread count that followed the
# machine would give different bytes on different machines. A constant keeps the file (and its
# sha256, which checkpoints record) the same everywhere.
_TRAIN_THREADS = 4


class Tokenizer:
    """A loaded SentencePiece model with aiayn's fixed special ids, or an imported Marian
    vocabulary (aiayn.tokenizer.marian): a source and a target model whose pieces map through one
    table. Every caller reads ids, pieces and text through the methods below, which take the
    side (source or target) a text is on."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise TokenizerError(
                f"tokenizer model not found: {self.path}. Train one with "
                "`aiayn tokenizer train --config FILE`, or set tokenizer.path to an existing "
                ".model file"
            )
        data = self.path.read_bytes()
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.bundle = None
        self._ids: dict[str, int] | None = None  # piece -> id where the pieces are not spm's
        if data.startswith(marian.MAGIC):
            self.bundle = marian.read_bundle(data, str(self.path))
            self.sp = self._load(self.bundle.source_spm, "source.spm")
            self.target_sp = self._load(self.bundle.target_spm, "target.spm")
            self._pieces = self.bundle.pieces()
            self._ids = {p: i for i, p in reversed(list(enumerate(self._pieces)))}
            self.vocab_size = len(self._pieces)
            self.pad_id, self.unk_id, self.bos_id, self.eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID
            self.type = "marian"
            return
        self.sp = self.target_sp = self._load(data, "")
        self.vocab_size = self.sp.vocab_size()
        self.pad_id, self.unk_id = self.sp.pad_id(), self.sp.unk_id()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        found = (self.pad_id, self.unk_id, self.bos_id, self.eos_id)
        if found != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise TokenizerError(
                f"{self.path} has special ids pad/unk/bos/eos = {found}, but aiayn needs "
                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; train the tokenizer with "
                "`aiayn tokenizer train --config FILE`"
            )
        self.type = _model_type(data)

    def _load(self, data: bytes, member: str) -> spm.SentencePieceProcessor:
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError) as exc:
            where = f"{self.path} ({member})" if member else str(self.path)
            raise TokenizerError(
                f"{where} is not a SentencePiece model ({exc}); retrain it with "
                "`aiayn tokenizer train --config FILE`"
            ) from None
        return sp

    def encode(
        self, texts: list[str], threads: int | None = None, side: str = "source"
    ) -> list[list[int]]:
        """Token ids of each text, without bos/eos (the data path adds what each side needs).
        side: "target" for a translation's target text (a Marian vocabulary segments it with
        its target model; a joint one is the same on both sides).

        threads: SentencePiece's native encoding threads (None: its default, every core). It
        releases the GIL meanwhile (sentencepiece 0.2.3), so Python threads go on reading.
        """
        sp = self.target_sp if side == "target" else self.sp
        if self._ids is None:
            return sp.encode(list(texts), out_type=int, num_threads=threads)
        # As MarianTokenizer: a leading >>xx<< language code split off, the rest segmented into
        # piece strings, each looked up in the joint vocabulary, so a piece this side's model
        # does not know (an unknown character) still finds the other side's id.
        split = [marian.language_code(t) for t in texts]
        codes = [code for code, _ in split]
        pieces = sp.encode([rest for _, rest in split], out_type=str, num_threads=threads)
        ids, unk = self._ids, self.unk_id
        return [[ids.get(p, unk) for p in c + row] for c, row in zip(codes, pieces, strict=True)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text of each id sequence: cut at the first eos, pad and bos dropped."""
        rows = []
        for row in ids:
            row = [int(i) for i in row]
            if self.eos_id in row:
                row = row[: row.index(self.eos_id)]
            rows.append([i for i in row if i != self.pad_id and i != self.bos_id])
        if self._ids is None:
            return self.sp.decode(rows)
        pieces = [[self._pieces[i] for i in row if i != self.unk_id] for row in rows]
        return [marian.decode_pieces(self.target_sp, row) for row in pieces]

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(i) if self._ids is None else self._pieces[i]

    def piece_to_id(self, piece: str) -> int:
        if self._ids is None:
            return self.sp.piece_to_id(piece)
        return self._ids.get(piece, self.unk_id)

    def contract(self) -> dict:
        """What a run records about its tokenizer, to refuse a different one at resume."""
        return {
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "unk_id": self.unk_id,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "type": self.type,
        }


def _model_type(data: bytes) -> str:
    from sentencepiece import sentencepiece_model_pb2 as pb  # protobuf comes with tensorboard

    proto = pb.ModelProto()
    proto.ParseFromString(data)
    return pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()


def check_contract(recorded: dict, tok: Tokenizer, where: str) -> None:
    """Raise TokenizerError listing every field where `tok` differs from what `where` recorded."""
    found = tok.contract()
    diffs = [
        f"  - {key}: recorded {recorded[key]!r}, found {found.get(key)!r}"
        for key in recorded
        if recorded[key] != found.get(key)
    ]
    if diffs:
        lines = "\n".join(diffs)
        raise TokenizerError(
            f"tokenizer {tok.path} is not the one {where} was trained with:\n{lines}\n"
            "Token ids would mean different words. Use the tokenizer the run was trained with "
            "(set tokenizer.path to it), or start a new run_dir."
        )


def train_tokenizer(cfg: TokenizerConfig, sentences: Iterable[str], out_path: Path) -> Tokenizer:
    """Train a SentencePiece model on `sentences` and write out_path (.model, .vocab, .json).

    The same sentences in the same order give the same bytes. Files appear atomically: a
    crash leaves either the old files or the new ones, never a half-written model.
    """
    out_path = Path(out_path)
    sents = [s for s in sentences if s and not s.isspace()]
    if not sents:
        raise TokenizerError(
            "no sentences to train the tokenizer on: the training split is empty; check data.train"
        )
    model = io.BytesIO()  # in memory: no temp path ends up inside the model file
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sents),
            model_writer=model,
            model_type=cfg.type,
            vocab_size=cfg.vocab_size,
            character_coverage=cfg.character_coverage,
            **_non_default_options(cfg),
            user_defined_symbols=list(cfg.user_symbols),
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            input_sentence_size=0,  # the caller already sampled; use every sentence given
            num_threads=_TRAIN_THREADS,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise _training_error(cfg, len(sents), str(exc)) from None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".spm-", dir=out_path.parent))
    try:
        (tmp / "spm.model").write_bytes(model.getvalue())
        tok = Tokenizer(tmp / "spm.model")
        vocab = "".join(
            f"{tok.sp.id_to_piece(i)}\t{tok.sp.get_score(i):g}\n" for i in range(tok.vocab_size)
        )
        (tmp / "spm.vocab").write_text(vocab, encoding="utf-8")
        contract = {**tok.contract(), "sentences": len(sents)}
        (tmp / "spm.json").write_text(json.dumps(contract, indent=2) + "\n")
        # The .model goes last: its presence means its companions are complete.
        os.replace(tmp / "spm.vocab", out_path.with_suffix(".vocab"))
        os.replace(tmp / "spm.json", out_path.with_suffix(".json"))
        os.replace(tmp / "spm.model", out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Tokenizer(out_path)


def _non_default_options(cfg: TokenizerConfig) -> dict:
    """SentencePiece options that differ from its defaults, and only those: an option passed
    even at its default value changes the model file's bytes (and sha256), so every tokenizer
    trained before these options existed keeps its bytes."""
    options = {}
    if cfg.normalization != "nmt_nfkc":
        options["normalization_rule_name"] = cfg.normalization
    if not cfg.remove_extra_whitespaces:
        options["remove_extra_whitespaces"] = False
    if cfg.type == "char":
        # vocab_size is an upper bound, and a dummy prefix would be one more token per line
        # with nothing to learn.
        options.update(hard_vocab_limit=False, add_dummy_prefix=False)
    if "<unk>" in cfg.user_symbols:
        # A corpus may spell its own unknown word "<unk>" (WikiText): as a user symbol it
        # needs SentencePiece's piece of that name renamed.
        options["unk_piece"] = "<sp_unk>"
    return options


def _training_error(cfg: TokenizerConfig, n: int, message: str) -> TokenizerError:
    too_high = re.search(r"Vocabulary size too high .*<= (\d+)", message)
    if too_high:
        more = (
            "or raise tokenizer.sample_sentences to train on more of the corpus"
            if n >= cfg.sample_sentences
            else "or train on a larger corpus (these are all its sentences)"
        )
        return TokenizerError(
            f"tokenizer.vocab_size {cfg.vocab_size} is too large for the {n} training sentences: "
            f"SentencePiece can make at most {too_high.group(1)} pieces from them. Set "
            f"tokenizer.vocab_size <= {too_high.group(1)}, {more}"
        )
    if "smaller than required_chars" in message:
        return TokenizerError(
            f"tokenizer.vocab_size {cfg.vocab_size} is too small to hold every character of the "
            f"corpus ({message.rsplit(']', 1)[-1].strip()}); raise tokenizer.vocab_size or lower "
            "tokenizer.character_coverage"
        )
    return TokenizerError(f"SentencePiece training failed: {message}; check the tokenizer section")
