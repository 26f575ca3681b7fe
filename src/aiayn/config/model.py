"""What the model is: the `model` section (its architecture, and MODEL_PRESETS, the paper's
sizes and small ones) and the `tokenizer` section (the one joint vocabulary it embeds)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from aiayn.config.checks import Section, bounded, suggest

# Table 3 of the paper, plus small presets that train on a laptop CPU in minutes.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "transformer_base": dict(N=6, d_model=512, d_ff=2048, h=8, dropout=0.1),
    "transformer_big": dict(N=6, d_model=1024, d_ff=4096, h=16, dropout=0.3),
    "small": dict(N=3, d_model=256, d_ff=1024, h=4, dropout=0.1),
    "tiny": dict(N=2, d_model=128, d_ff=512, h=4, dropout=0.1),
}


@dataclass
class ModelConfig(Section):
    kind: Literal["seq2seq", "lm", "classifier"] = "seq2seq"
    """seq2seq: encoder-decoder (translation); lm: decoder only; classifier: encoder + head."""
    preset: str | None = None
    """Name from MODEL_PRESETS; its values apply unless a key is set explicitly."""
    N: int = bounded(6, low=1)
    """Layers in the encoder, and in the decoder unless decoder_layers is set (§3.1)."""
    decoder_layers: int | None = bounded(None, low=1)
    """Decoder layers when they differ from N."""
    d_model: int = bounded(512, low=1)
    """Width of every sublayer's input and output, and of the embeddings (§3.1)."""
    d_ff: int = bounded(2048, low=1)
    """Inner width of the position-wise feed-forward network (§3.3)."""
    h: int = bounded(8, low=1)
    """Attention heads; d_k = d_v = d_model / h (§3.2.2)."""
    dropout: float = bounded(0.1, low=0, high=1, high_open=True)
    """Residual and embedding dropout, P_drop (§5.4)."""
    attention_dropout: float = bounded(0.0, low=0, high=1, high_open=True)
    """Dropout on attention weights (not in the paper; tensor2tensor uses it)."""
    positions: Literal["sinusoidal", "sinusoidal_concat", "learned"] = "sinusoidal"
    """Sinusoidal encodings (§3.5: sin and cos interleaved), sinusoidal_concat (the same
    sines in the first half of the dimensions, the cosines in the second: tensor2tensor's,
    fairseq's and Marian's layout), or learned position embeddings."""
    norm: Literal["post", "pre"] = "post"
    """post: LayerNorm(x + Sublayer(x)) as in the paper; pre: x + Sublayer(LayerNorm(x))."""
    max_len: int = bounded(1024, low=1)
    """Longest sequence (in tokens) the position table covers."""
    activation: Literal["relu", "swish"] = "relu"
    """The feed-forward network's activation: relu (§3.3), or swish, x * sigmoid(x) (SiLU;
    Marian's OPUS-MT models)."""
    attention_bias: bool = False
    """Biases on the attention projections W^Q, W^K, W^V and W^O (§3.2.2 has none; Marian's
    models do)."""
    output_bias: bool = False
    """A bias on the pre-softmax output projection (Marian's final_logits_bias)."""
    share_embeddings: Literal["all", "decoder", "none"] = "all"
    """all: source, target and output share one matrix (needs the joint vocabulary, §3.4);
    decoder: target embedding and output projection; none: three separate matrices.
    An lm has no source side, so all means decoder there."""
    num_classes: int = bounded(2, low=1)
    """Output classes (classifier only)."""
    pooling: Literal["mean", "first"] = "mean"
    """How the classifier pools encoder states: mean over non-pad tokens, or the first token."""

    def validate(self) -> list[str]:
        errs = []
        if self.h >= 1 and self.d_model % self.h:
            errs.append(f"model.d_model ({self.d_model}) must be divisible by model.h ({self.h})")
        if self.preset is not None and self.preset not in MODEL_PRESETS:
            errs.append(
                f"model.preset {self.preset!r} is not a preset; choose from "
                f"{sorted(MODEL_PRESETS)}" + suggest(self.preset, MODEL_PRESETS)
            )
        return errs


@dataclass
class TokenizerConfig(Section):
    path: str | None = None
    """SentencePiece model file; default <run_dir>/tokenizer/spm.model. Trained if missing."""
    type: Literal["bpe", "unigram", "char"] = "bpe"
    """SentencePiece model type; char: one piece per character (vocab_size is then an upper
    bound: the vocabulary is the corpus's characters plus the four specials)."""
    vocab_size: int = bounded(8000, low=8)
    """Size of the one joint source+target vocabulary (§3.4 shares it between languages)."""
    normalization: Literal["nmt_nfkc", "nfkc", "identity"] = "nmt_nfkc"
    """SentencePiece's normalization rule. identity, with remove_extra_whitespaces false, makes
    decode(encode(text)) == text, so that a score per character is a score of the exact text."""
    remove_extra_whitespaces: bool = True
    """Drop leading and trailing spaces and collapse runs of spaces before encoding."""
    character_coverage: float = bounded(1.0, low=0, low_open=True, high=1)
    """Share of characters covered by the vocabulary (0.9995 for scripts with many characters)."""
    sample_sentences: int = bounded(1_000_000, low=1)
    """At most this many sentences, read from the training stream, train the tokenizer."""
    user_symbols: list[str] = field(default_factory=list)
    """Extra symbols that are never split (e.g. language tags)."""
    seed: int = 1
    """Seed of the sentence sample; the same seed gives the same tokenizer."""
