"""Techniques applied to a built model from outside it: activation checkpointing and compile.

Both work on the encoder and decoder layers, the repeated unit, and change them in place, so
parameter names (which checkpoints and distributed/reshard.py key on) stay the same with or
without them. The model's own code knows of neither (torchtitan's apply_ac/apply_compile).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from aiayn.config import Config
from aiayn.model.layers import DecoderLayer, EncoderLayer


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Each layer's activations are recomputed in the backward pass instead of stored.

    The layer's `forward` is wrapped on the instance; in training with gradients on it runs
    under `torch.utils.checkpoint` (non-reentrant: the RNG state is replayed, so dropout draws
    the same masks in the recomputation). Evaluation and decoding run it unchanged.
    """
    for layer in _layers(model):
        forward = layer.forward

        @functools.wraps(forward)
        def checkpointed(*args, _layer=layer, _forward=forward, **kwargs):
            if _layer.training and torch.is_grad_enabled():
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        layer.forward = checkpointed


def apply_compile(model: nn.Module) -> None:
    """torch.compile each encoder and decoder layer in place.

    Layers, not the model: one compiled graph serves all N, and the output projection after
    them runs on a data-dependent number of rows (the non-pad targets), which would break a
    whole-model graph.
    """
    for layer in _layers(model):
        layer.compile()


def apply(model: nn.Module, cfg: Config) -> None:
    """What the run config asks for; checkpointing first, so compile traces the wrapped layer."""
    if cfg.distributed.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.train.compile:
        apply_compile(model)
