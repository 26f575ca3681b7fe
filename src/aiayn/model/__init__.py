"""The Transformer models: plain single-device PyTorch, built from a ModelConfig."""

from aiayn.model.transformer import (
    DecoderOnlyLM,
    DecoderState,
    EncoderClassifier,
    Seq2SeqTransformer,
    build_model,
    count_parameters,
    vocab_parameters,
)

__all__ = [
    "DecoderOnlyLM",
    "DecoderState",
    "EncoderClassifier",
    "Seq2SeqTransformer",
    "build_model",
    "count_parameters",
    "vocab_parameters",
]
