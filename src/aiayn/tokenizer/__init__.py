"""Tokenizers: SentencePiece, trained and loaded by the project, with the contract a run records
(spm.py); and an imported Marian model's two SentencePiece models and joint vocabulary, kept as
one bundle that `Tokenizer` loads like any other (marian.py)."""

from aiayn.tokenizer.spm import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    check_contract,
    train_tokenizer,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "Tokenizer",
    "check_contract",
    "train_tokenizer",
]
