"""A located model's weights into a new model, whole or but for the parameters init.exclude
names, or with its vocabulary rows mapped by piece (init.vocab=remap); and its Adam moments into
a built engine (init.optimizer=keep), read as a resume on another topology reads them."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, load_model
from torch import nn

from aiayn.checkpoint.format import read_manifest, read_trainer_state
from aiayn.checkpoint.locate import Located
from aiayn.errors import CheckpointError
from aiayn.model import selection, vocab_parameters
from aiayn.tokenizer import Tokenizer


def load_weights(
    model: nn.Module,
    found: Located,
    exclude: list[str] = (),
    remap: tuple[Tokenizer, Tokenizer] | None = None,
) -> dict[str, int]:
    """The source's weights into `model` (built from the merged config, not yet wrapped by an
    engine, so that DDP ranks start identical and ZeRO-3 partitions them), except the
    parameters init.exclude names, which keep the values the model was initialised with.
    `remap` (the source's tokenizer, this run's): init.vocab=remap, below. Returns counts for
    the log and the record: values left fresh, and with remap the pieces kept and new."""
    fresh = {}
    if exclude:
        chosen = selection.matching(model, list(exclude), "init.exclude")
        fresh = {p: p.detach().clone() for p in model.parameters() if id(p) in chosen}
    counts = {"fresh": sum(v.numel() for v in fresh.values())}
    if remap is None:
        try:
            missing, unexpected = load_model(model, str(found.weights), strict=False)
        except RuntimeError as exc:  # shapes
            raise CheckpointError(f"{found.weights} does not fit this model: {exc}") from None
        if missing or unexpected:
            raise CheckpointError(
                f"{found.weights} does not fit this model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
    else:
        counts |= _load_remapped(model, found, *remap)
    with torch.no_grad():
        for param, value in fresh.items():
            param.copy_(value)
    return counts


def load_moments(engine, found: Located, cfg) -> None:
    """init.optimizer=keep: Adam's moments and step count from the source's training checkpoint
    into the built engine, read by parameter name as a resume on another topology reads them
    (checkpoint/reshard.py: each ZeRO rank its partition); the schedule, the skipped-step
    count and everything else stay this run's. Refused, saying why, where the source has no
    optimizer state or trained another set of parameters."""
    from aiayn.checkpoint import reshard
    from aiayn.engine.state import trainable

    if found.kind != "checkpoint":
        what = {"export": "an export", "ema": "a moving average of the weights (train.ema)"}
        raise CheckpointError(
            f"init.optimizer=keep takes Adam's moments from a training checkpoint, and "
            f"{found.name} is {what.get(found.kind, 'an averaged model')}, whose weights "
            "no Adam state belongs to: name one of the run's checkpoints, or set "
            "init.optimizer=reset"
        )
    source_cfg = found.config.get("train", {})
    theirs, ours = list(source_cfg.get("freeze", [])), list(cfg.train.freeze)
    if theirs != ours:
        raise CheckpointError(
            f"init.optimizer=keep continues the source's Adam state parameter by parameter, but "
            f"the source trained with train.freeze={theirs} and this run has {ours}: the sets "
            "of trained parameters differ. Use the same train.freeze, or init.optimizer=reset"
        )
    trainer_state = read_trainer_state(found.checkpoint, lambda key: key.startswith("/engine/"))
    manifest = read_manifest(found.checkpoint, verify=False)
    saved = reshard.topology_of(manifest, trainer_state)
    shapes = {name: p.shape for name, p in trainable(engine.module)}
    with reshard.read(found.checkpoint, trainer_state, saved, shapes) as state:
        # this run's fresh schedule, not the source's position in its own
        state.scheduler, state.skipped_steps = engine.scheduler.state_dict(), 0
        engine.load_portable(state)


def piece_map(source: Tokenizer, tok: Tokenizer) -> list[int | None]:
    """For each id of `tok`, the source's id of the same piece string (the four specials by
    role: aiayn fixes their ids), or None where the source has no such piece."""
    ids = {source.id_to_piece(i): i for i in range(source.vocab_size)}
    specials = {tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id}
    return [j if j in specials else ids.get(tok.id_to_piece(j)) for j in range(tok.vocab_size)]


def _load_remapped(model: nn.Module, found: Located, source: Tokenizer, tok: Tokenizer) -> dict:
    """init.vocab=remap: every tensor as stored, except the vocabulary matrices, whose rows are
    taken by piece (piece_map); rows of pieces the source lacks keep the model's own init."""
    stored = load_file(found.weights)
    rows = {id(p) for p in vocab_parameters(model)}
    mapping = piece_map(source, tok)
    ours = torch.tensor([j for j, i in enumerate(mapping) if i is not None])
    theirs = torch.tensor([i for i in mapping if i is not None])
    names = selection.names_by_parameter(model)
    params = {id(p): p for p in model.parameters()}
    used = set()
    with torch.no_grad():
        for pid, group in names.items():
            key = next((n for n in group if n in stored), None)
            if key is None:
                raise CheckpointError(f"{found.weights} does not fit this model: no {group[0]}")
            used.add(key)
            param, value = params[pid], stored[key]
            if pid in rows and value.shape[1:] == param.shape[1:]:
                param[ours] = value[theirs].to(param.dtype)
            elif value.shape == param.shape:
                param.copy_(value)
            else:
                raise CheckpointError(
                    f"{found.weights} does not fit this model: {key} is {tuple(value.shape)} "
                    f"there, {tuple(param.shape)} here"
                )
        for name, buffer in model.named_buffers():
            if name in stored:
                used.add(name)
                buffer.copy_(stored[name])
    unexpected = sorted(set(stored) - used)
    if unexpected:
        raise CheckpointError(
            f"{found.weights} does not fit this model: unexpected {unexpected[:5]}"
        )
    kept = len(theirs)
    return {"pieces_kept": kept, "pieces_new": tok.vocab_size - kept}
