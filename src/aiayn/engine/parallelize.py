"""Techniques applied to a built model from outside it: activation checkpointing and compile.

Both work on the encoder and decoder layers, the repeated unit, and change them in place, so
parameter names (which checkpoints and checkpoint/reshard.py key on) stay the same with or
without them. The model's own code knows of neither (torchtitan's apply_ac/apply_compile).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx.experimental._config
from torch import nn
from torch.utils.checkpoint import checkpoint

from aiayn.config import Config
from aiayn.model.layers import DecoderLayer, EncoderLayer


def layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Each layer's activations are recomputed in the backward pass instead of stored.

    The layer's `forward` is wrapped on the instance; in training with gradients on it runs
    under `torch.utils.checkpoint` (non-reentrant: the RNG state is replayed, so dropout draws
    the same masks in the recomputation). Evaluation and decoding run it unchanged.
    """
    for layer in layers(model):
        forward = layer.forward

        @functools.wraps(forward)
        def checkpointed(*args, _layer=layer, _forward=forward, **kwargs):
            if _layer.training and torch.is_grad_enabled():
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        layer.forward = checkpointed


GRAPH_BUDGET = 12
"""Compiled graphs a layer kind may have (torch's recompile limit, per code object; its default
is 8). Replaying an epoch of token-budget batches, a validation pass and a beam search takes 4
encoder and 9 decoder graphs (tests/unit/test_compile_shapes.py); past the budget a run stops,
where torch would silently run the layer uncompiled for the rest of it."""


def apply_compile(model: nn.Module, backend: str | Callable = "inductor") -> None:
    """torch.compile each encoder and decoder layer in place.

    Layers, not the model: one compiled graph serves all N, and the output projection after
    them runs on a data-dependent number of rows (the non-pad targets), which would break a
    whole-model graph.

    Token-budget batches come in hundreds of (rows, width) shapes an epoch. With torch's
    default, each layer is compiled static for the first shape and again, dynamic, for the
    second; sizes are compiled dynamic from the start here (dynamic=True), which measured
    fewer graphs over an epoch, a validation and a beam search (benchmarks/README.md). Sizes 0
    and 1 are still specialised: a batch of one row or a decoding step of one token is a graph
    of its own, within the budget.
    """
    torch._dynamo.config.recompile_limit = GRAPH_BUDGET
    # Duck sizing would make a first batch whose source and target widths are equal (common
    # when widths are rounded to a multiple) compile a graph in which they must stay equal.
    torch.fx.experimental._config.use_duck_shape = False
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for layer in layers(model):
        layer.compile(backend=backend, dynamic=True)


def apply(model: nn.Module, cfg: Config) -> None:
    """What the run config asks for; checkpointing first, so compile traces the wrapped layer."""
    if cfg.distributed.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.train.compile:
        apply_compile(model)
