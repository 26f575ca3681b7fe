"""An ensemble of translation models decoded as one: at each step, the mean of the members'
log-probabilities (`aiayn translate|evaluate --checkpoint A --checkpoint B`, or a glob).

The mean of log-probabilities (a product of experts: Marian's ensembles, OpenNMT-py's), not
fairseq's log of the mean of probabilities, for two reasons: a hypothesis's ensemble score is
then the mean of the members' scores, which a reranker reads as it reads one model's; and one
model given twice is that model bit for bit ((x + x) / 2 == x in floating point, where
logsumexp(x, x) - log 2 is x only to rounding), which is the check that the ensemble's
plumbing is right. The members may be any models over the same tokenizer (the same
vocabulary in and out); their sizes may differ.
"""

from __future__ import annotations

import glob
from pathlib import Path

import torch

from aiayn.errors import ConfigError
from aiayn.model import DecoderState


class _Each:
    """One value per member (encoder outputs, decoder states), indexed and reordered together."""

    def __init__(self, items):
        self.items = list(items)

    def __getitem__(self, index):
        return _Each(item[index] for item in self.items)


class _States(_Each):
    def reorder(self, index: torch.Tensor) -> None:
        for state in self.items:
            state.reorder(index)

    def select_sources(self, index: torch.Tensor) -> None:
        for state in self.items:
            state.select_sources(index)


class Ensemble:
    """Translation models decoded together; to the searches (decode.py, beam.py), one model."""

    log_probs = True  # decode returns log-probabilities (decode.log_probs)

    def __init__(self, models: list):
        self.models = models
        self.cfg = min((m.cfg for m in models), key=lambda cfg: cfg.max_len)  # the shortest

    @property
    def training(self) -> bool:
        return self.models[0].training

    def train(self, mode: bool = True):
        for model in self.models:
            model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self):
        return self.models[0].parameters()

    def new_state(self) -> _States:
        return _States(DecoderState() for _ in self.models)

    def encode(self, src: torch.Tensor):
        """Each member's encoder output; the source mask is the same for all (one tokenizer)."""
        outs = [model.encode(src) for model in self.models]
        return _Each(memory for memory, _ in outs), outs[0][1]

    def decode(self, tgt, memory: _Each, src_mask, state: _States):
        """(rows, T, V) the mean of the members' log-probabilities."""
        total = None
        for model, mem, st in zip(self.models, memory.items, state.items, strict=True):
            logp = torch.log_softmax(model.decode(tgt, mem, src_mask, st).float(), dim=-1)
            total = logp if total is None else total + logp
        return total / len(self.models)


def checkpoint_paths(values: list[str] | str) -> list[str]:
    """--checkpoint's values, each a path or a glob (expanded, sorted); ConfigError when a glob
    matches nothing."""
    out = []
    for value in [values] if isinstance(values, str) else values:
        if any(ch in value for ch in "*?["):
            found = sorted(glob.glob(value))
            if not found:
                raise ConfigError(f"--checkpoint {value}: the pattern matches nothing")
            out += found
        else:
            out.append(value)
    return out


def check_same_vocabulary(names: list[str], tokenizers: list) -> None:
    """ConfigError unless every member reads and writes the first one's vocabulary."""
    first = tokenizers[0]
    pieces = [first.id_to_piece(i) for i in range(first.vocab_size)]
    for name, tok in zip(names[1:], tokenizers[1:], strict=True):
        same = tok.vocab_size == first.vocab_size and all(
            tok.id_to_piece(i) == p for i, p in enumerate(pieces)
        )
        if not same:
            raise ConfigError(
                f"{name} has another vocabulary than {names[0]} ({tok.vocab_size} pieces against "
                f"{first.vocab_size}, or other pieces): an ensemble averages the members' "
                "probabilities token by token, so its models must share one tokenizer; "
                "ensemble only models trained with the same tokenizer.path"
            )


def load_ensemble(checkpoints: list, overrides: list[str], device):
    """(cfg, model, tok, the checkpoints found) as load_for_inference gives them, for one
    checkpoint or more (paths, or what checkpoint.locate found of them): several become an
    Ensemble, with the first one's config (and the overrides) deciding how to decode."""
    from aiayn.checkpoint.inference import load_for_inference

    loaded = [load_for_inference(c, overrides, device) for c in checkpoints]
    if len(loaded) == 1:
        cfg, model, tok, path = loaded[0]
        return cfg, model, tok, [Path(path)]
    kinds = {cfg.model.kind for cfg, _, _, _ in loaded}
    if kinds != {"seq2seq"}:
        raise ConfigError(f"an ensemble is of translation (seq2seq) models; these are {kinds}")
    check_same_vocabulary([str(path) for *_, path in loaded], [tok for _, _, tok, _ in loaded])
    cfg, _, tok, _ = loaded[0]
    models = [model for _, model, _, _ in loaded]
    return cfg, Ensemble(models), tok, [Path(path) for _, _, _, path in loaded]
