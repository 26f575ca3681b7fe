"""How a seq2seq model translates and is scored: the `decode` section (beam search, §6.1,
and the sacreBLEU tokenizer), for `aiayn translate`, the test set and validation BLEU."""

from __future__ import annotations

from dataclasses import dataclass

from aiayn.config.checks import Section, bounded

BLEU_TOKENIZERS = ("13a", "intl", "char", "none", "zh", "ja-mecab", "flores200")
"""The sacreBLEU tokenizers decode.bleu_tokenize and `aiayn score --tokenize` accept."""


@dataclass
class DecodeConfig(Section):
    beam: int = bounded(4, low=1)
    """Beam size; 1 is greedy search (§6.1 uses 4)."""
    alpha: float = 0.6
    """Length penalty ((5 + len) / 6)^alpha (§6.1)."""
    max_len_b: int = bounded(50, low=1)
    """Hypotheses stop at source length + max_len_b tokens (§6.1)."""
    min_len: int = bounded(1, low=0)
    """Tokens a hypothesis has at least before eos (fairseq's min_len; 0: none). With 0, beam
    search under the length penalty takes the empty hypothesis (eos first) wherever the model
    is unsure of a long sentence: 3.9% of a Multi30k en->de model's outputs (docs/recipes.md).
    An empty source line is translated as an empty line either way."""
    batch_size: int = bounded(64, low=1)
    """Sentences decoded together."""
    bleu_tokenize: str = "13a"
    """sacreBLEU tokenizer: 13a (WMT standard), intl, char (for one-word targets), none."""

    def validate(self) -> list[str]:
        errs = []
        if self.bleu_tokenize not in BLEU_TOKENIZERS:
            errs.append(f"decode.bleu_tokenize {self.bleu_tokenize!r} is not a sacreBLEU tokenizer")
        return errs
