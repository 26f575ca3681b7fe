"""The exponential moving average of the weights (train.ema), kept beside the model by the
engine: after every optimizer step, ema = d * ema + (1 - d) * w, in fp32, where update t
(from 0) uses d = min(decay, (1 + t) / (10 + t)) with train.ema_warmup (Marian's exponential
smoothing and TensorFlow's ExponentialMovingAverage with num_updates) and d = decay without.

Marian smooths by default and fairseq offers `--ema`: a cheap alternative or complement to
averaging the last checkpoints (§6.1), at the cost of one fp32 copy of the weights and two
foreach kernels a step (no host sync). Each rank keeps the EMA of what it holds: the
whole trainable parameters under one process, DDP and ZeRO 0-2 (as every rank holds the
weights), and its own ZeRO-3 partition of each under ZeRO-3, so the EMA is never whole on a
rank. A save writes it as `ema.safetensors` beside `model.safetensors`, with the same names
and ties, so it loads as a model (`RUN/ema`); the checkpoint package does that, through the
engine's `ema_weights()` (a `Weights`, as a save of the model is), and hands a resume's reads
to `load`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aiayn.engine.state import Weights

Read = Callable[[str, int, int], torch.Tensor]
"""Elements [start, end) of a tensor of ema.safetensors, flattened, by its name there."""

Sources = Callable[[], list[torch.Tensor]]
"""A rank's share of the trainable weights, in its pieces' order."""

Gather = Callable[[int, torch.Tensor], torch.Tensor]
"""(i, this rank's piece of parameter i) -> the whole flattened parameter (a collective)."""

UPDATES_KEY = "aiayn_ema_updates"
"""ema.safetensors' metadata: the updates the average has had, which the warm-up's decay
follows; a resume takes it up there, so that it repeats the decays of a run not stopped."""


@dataclass(frozen=True)
class Piece:
    """What a rank keeps of one trainable parameter: elements [start, end) of the flattened
    tensor in a buffer of `size` (ZeRO-3 pads the last rank's partition with zeros)."""

    key: str  # its name in model.safetensors: the first of its tied names, sorted
    shape: torch.Size
    start: int
    end: int
    size: int


class EMA:
    """The EMA of one rank's share of the trainable weights. `sources()` gives that share's
    tensors in `pieces`' order (the parameters, or their ZeRO-3 partitions); `gather(i)` the
    whole flattened parameter i from every rank's piece of it (a collective under ZeRO-3)."""

    def __init__(
        self,
        decay: float,
        pieces: list[Piece],
        sources: Sources,
        gather: Gather | None = None,
        warmup: bool = True,
    ):
        self.decay = decay
        self.warmup = warmup
        # None: the warm-up is over (a checkpoint saved before the count was kept, whose run
        # had no warm-up); decays follow `decay` from there.
        self.updates: int | None = 0
        self.pieces = pieces
        self._sources = sources
        self._gather = gather
        self.shadow: list[torch.Tensor] | None = None  # fp32, one per piece; None: not begun

    def begin(self) -> None:
        """Start from the current weights, unless begun or loaded: called before the first
        update, so the average includes the weights the run started from."""
        if self.shadow is None:
            with torch.no_grad():
                self.shadow = [t.detach().float().clone() for t in self._sources()]

    def current_decay(self) -> float:
        """The decay the next update uses. The warm-up's keeps the average from being mostly
        the random initial weights in a run that is short for `decay` (0.999 keeps 22% of
        them after 1,500 steps without it): early on it follows the recent weights."""
        if not self.warmup or self.updates is None:
            return self.decay
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """ema = d * ema + (1 - d) * w, after an optimizer step."""
        self.begin()
        decay = self.current_decay()
        weights = [t if t.dtype == torch.float32 else t.float() for t in self._sources()]
        torch._foreach_mul_(self.shadow, decay)
        torch._foreach_add_(self.shadow, weights, alpha=1.0 - decay)
        if self.updates is not None:
            self.updates += 1

    def load(self, read: Read, metadata: dict[str, str]) -> None:
        """This rank's pieces from a checkpoint's ema.safetensors, each read by range, and from
        its `metadata` the updates the average had had (none there: saved before the count was
        kept, warm-up over)."""
        updates = metadata.get(UPDATES_KEY)
        self.updates = None if updates is None else int(updates)
        shadow = []
        for piece, source in zip(self.pieces, self._sources(), strict=True):
            out = torch.zeros(piece.size, dtype=torch.float32, device=source.device)
            if piece.start < piece.end:
                out[: piece.end - piece.start] = read(piece.key, piece.start, piece.end)
            shadow.append(out.view(source.shape))
        self.shadow = shadow

    def weights(self, base: Weights) -> Weights:
        """`base` (what a save writes into model.safetensors) with each trainable tensor's
        value the EMA's, in fp32: what a save writes into ema.safetensors. Under ZeRO-3 each
        is gathered as the save reaches it, one at a time, as the model's are."""
        self.begin()
        index = {piece.key: i for i, piece in enumerate(self.pieces)}
        metadata = dict(base.metadata or {})
        if self.updates is not None:
            metadata[UPDATES_KEY] = str(self.updates)
        specs = dict(base.specs)
        for piece in self.pieces:
            if piece.key not in specs:
                raise KeyError(f"the EMA's {piece.key} is not among the model's saved weights")
            specs[piece.key] = torch.empty(piece.shape, dtype=torch.float32, device="meta")

        def each(names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                if name not in index:
                    yield from base.each([name])  # a buffer, or a frozen parameter
                    continue
                yield name, self.whole(index[name])

        transient = base.transient or self._gather is not None
        return Weights(specs, metadata, each, transient=transient)

    def whole(self, i: int) -> torch.Tensor:
        """The EMA of trainable parameter i, whole: under ZeRO-3 gathered from every rank's
        piece (a collective), and gone once the caller drops it."""
        self.begin()
        shape = self.pieces[i].shape
        if self._gather is None:
            return self.shadow[i].view(shape)
        return self._gather(i, self.shadow[i].reshape(-1))[: shape.numel()].view(shape)

    @contextlib.contextmanager
    def applied(self, targets: list[torch.Tensor]) -> Iterator[None]:
        """The EMA's values in `targets` (the tensors `sources()` gives, in place) while the
        `with` lasts, then the weights back, bit for bit: validating the EMA (train.ema_validate)
        with the engine's own forward, partitioned or not. Costs one copy of this rank's share
        of the weights."""
        self.begin()
        with torch.no_grad():
            kept = [t.detach().clone() for t in targets]
            for t, e in zip(targets, self.shadow, strict=True):
                t.copy_(e.view(t.shape))
        try:
            yield
        finally:
            with torch.no_grad():
                for t, k in zip(targets, kept, strict=True):
                    t.copy_(k)


@contextlib.contextmanager
def saved_weights(engine: Any) -> Iterator[Weights | None]:
    """An engine's `ema_weights()`: what a save writes into ema.safetensors, the engine's
    `weights()` with the EMA's values (None when train.ema is off)."""
    if engine.ema is None:
        yield None
        return
    with engine.weights() as base:
        yield engine.ema.weights(base)


def file_keys(module: nn.Module) -> dict[int, str]:
    """Each parameter's name in model.safetensors, by id: the first of its tied names, sorted
    (engine/state.py's weights_snapshot and the ZeRO-3 save keep that one)."""
    keys: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        keys[id(p)] = min(keys.get(id(p), name), name)
    return keys


def whole_pieces(module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> list[Piece]:
    """The pieces of a rank that holds every trainable parameter whole."""
    keys = file_keys(module)
    return [Piece(keys[id(p)], p.shape, 0, p.numel(), p.numel()) for _, p in params]
