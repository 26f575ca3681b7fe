"""Decoding a model whose forward is a collective (ZeRO-3's partitioned one): every rank calls
the same layers in the same order, a rank whose search has ended keeping step with the others."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.engine.loss import grad_free


class Lockstep:
    """ZeRO-3's partitioned model, decoded by every rank in step.

    Each forward of a ZeRO-3 layer gathers its parameters from every rank: all ranks must call
    the same layers in the same order. So the ranks start each batch together (an encode),
    and each decoding step is a round that every rank takes: a rank whose search has ended
    (`idle`) keeps feeding one row of its last state through the decoder, with its caches, so
    that it calls the layers the others call, until no rank has a step left (one sum per
    round). The search functions see the model (encode, decode, cfg) and nothing else."""

    partitioned = True  # decode.py: no_grad, not inference_mode (loss.grad_free)

    def __init__(self, model: nn.Module, env):
        self.model, self.env, self.cfg = model, env, model.cfg
        self._last = None  # this rank's last decoding step: a row of it to repeat when idle

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def encode(self, src: torch.Tensor):
        return self.model.encode(src)

    def parameters(self):
        return self.model.parameters()

    def decode(self, tgt, memory, src_mask, state=None, **kwargs):
        """A translation model's decoding step, in this rank's round."""
        self._round(active=True)
        self._last = (tgt[:1, -1:], memory[:1], src_mask[:1], state)
        return self.model.decode(tgt, memory, src_mask, state, **kwargs)

    def __call__(self, tokens, state=None, **kwargs):
        """A language model's step (sampling), in this rank's round."""
        self._round(active=True)
        self._last = (tokens[:1, -1:], None, None, None)
        return self.model(tokens, state=state, **kwargs)

    def idle(self) -> None:
        """After this rank's search of a batch (or its sampling): a step of a row of its last
        state while any rank still decodes. A translation model repeats a row of its own
        decoding, caches included, so that it calls the layers the others call (the
        cross-attention's key and value projections only at a sentence's first step); a
        language model calls the same layers at every step, and takes a one-token input."""
        if self._last is None:  # an lm rank that took no step (rank 0 alone samples)
            device = next(self.model.parameters()).device
            self._last = (torch.zeros(1, 1, dtype=torch.long, device=device), None, None, None)
        tgt, memory, src_mask, state = self._last
        if state is not None:
            first = torch.zeros(1, dtype=torch.long, device=tgt.device)
            state.select_sources(first)
            state.reorder(first)
        with grad_free(True):
            while self._round(active=False):
                if memory is None:
                    self.model(tgt)
                else:
                    self.model.decode(tgt, memory, src_mask, state)
        self._last = None

    def _round(self, active: bool) -> bool:
        """One round: how many ranks decode in it; True if any."""
        return self.env.sum([float(active)])[0] > 0
