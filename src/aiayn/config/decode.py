"""How a seq2seq model translates and is scored: the `decode` section (beam search, §6.1,
and the sacreBLEU tokenizer), for `aiayn translate`, the test set and validation BLEU."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiayn.config.checks import Section, bounded, range_errors

BLEU_TOKENIZERS = ("13a", "intl", "char", "none", "zh", "ja-mecab", "flores200")
"""The sacreBLEU tokenizers decode.bleu_tokenize and `aiayn score --tokenize` accept."""


@dataclass
class SamplingConfig(Section):
    """Translations sampled instead of searched (`decode.sampling.enabled=true`), for
    back-translation (Edunov et al. 2018): each sentence from its own generator, seeded from
    (seed, its place in the input), so a sample does not depend on the ranks or the batch."""

    enabled: bool = False
    """Sample each translation instead of beam search; decode.n_best samples per sentence."""
    temperature: float = bounded(1.0, low=0, low_open=True)
    """The logits are divided by it before sampling (1: the model's distribution)."""
    top_k: int = bounded(0, low=0)
    """Sample among the k most probable tokens only (0: all; 1: greedy search; Edunov et
    al.'s restricted sampling uses 10)."""
    top_p: float = bounded(1.0, low=0, high=1, low_open=True)
    """Sample among the most probable tokens whose mass reaches p (nucleus sampling; 1: all)."""
    seed: int = bounded(0, low=0)
    """The samples' seed, mixed with each sentence's place in the input."""


@dataclass
class NoiseConfig(Section):
    """Edunov et al. (2018) §3's noise on each (beam) translation's words, for the synthetic
    source side of back-translation; their settings: drop 0.1, blank 0.1, swap 3. Seeded by
    decode.sampling.seed and the sentence's place in the input, as sampling is."""

    drop: float = bounded(0.0, low=0, high=1)
    """Probability of deleting each word."""
    blank: float = bounded(0.0, low=0, high=1)
    """Probability of replacing each word by decode.noise.filler."""
    swap: int = bounded(0, low=0)
    """Words move at most this many positions (a local shuffle; 0: none)."""
    filler: str = "<blank>"
    """The word a blank leaves; a tokenizer.user_symbols entry keeps it one token."""


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
    n_best: int = bounded(1, low=1)
    """Hypotheses per sentence, best first, each with its score (`aiayn translate --n-best`);
    at most decode.beam: beam search keeps that many. Scores, BLEU and validation read the
    first."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)

    def validate(self) -> list[str]:
        errs = []
        for name in ("sampling", "noise"):
            section = getattr(self, name)
            errs += range_errors(section, f"decode.{name}") + section.validate()
        if self.n_best > self.beam and not self.sampling.enabled:
            errs.append(
                f"decode.n_best {self.n_best} is more than decode.beam {self.beam}: beam search "
                f"keeps {self.beam} hypotheses per sentence; set decode.beam={self.n_best} (or "
                "more), or a smaller n-best"
            )
        if self.bleu_tokenize not in BLEU_TOKENIZERS:
            errs.append(f"decode.bleu_tokenize {self.bleu_tokenize!r} is not a sacreBLEU tokenizer")
        return errs
