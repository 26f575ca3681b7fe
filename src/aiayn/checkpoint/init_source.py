"""Starting a run from a trained model (`init.source`): finding the source, recording it in the
run directory, the architecture and tokenizer it brings, and its weights.

What a source can be, read as `aiayn translate` reads a checkpoint (`locate`): a run directory
(its latest valid checkpoint, or RUN/best, RUN/latest, RUN/averaged), a step directory, an
averaged model, or a FILE.safetensors from `aiayn export`.

Restarts never re-initialise, by this order (train.py applies it):
1. The run has a valid checkpoint of its own: it resumes that, bitwise; the source is not read
   (a run directory whose checkpoints were started from another source, or from none, is
   refused, naming both).
2. The run has none yet, but recorded a source at an earlier start (RUN/init_source.json: the
   resolved checkpoint, its sha256, the architecture): it starts again from exactly that, even
   if the source run has saved newer checkpoints since; a changed or missing source is an error.
3. A first start: the source is resolved now (rank 0, for all), recorded, and loaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model
from torch import nn

from aiayn.checkpoint.format import (
    ARCHITECTURE_FIELDS,
    MANIFEST_FILE,
    MODEL_FILE,
    TRAINER_FILE,
    read_manifest,
    read_trainer_state,
    resolve_checkpoint,
    tokenizer_file,
)
from aiayn.errors import CheckpointError, ConfigError
from aiayn.files import sha256_of, write_atomic
from aiayn.model import selection, vocab_parameters
from aiayn.tokenizer import Tokenizer, check_contract

log = logging.getLogger(__name__)

RECORD = "init_source.json"  # in run_dir, written at the first start
# Settings outside the model whose change a fine-tune's log reports (None: the whole section).
SETTINGS = {
    "data": ["train"],
    "train": ["max_tokens", "grad_accum", "label_smoothing", "clip_norm", "precision"],
    "schedule": None,
    "optim": None,
}


@dataclass(frozen=True)
class Located:
    """A trained model's files: what load_for_inference and init.source both read."""

    weights: Path  # model.safetensors of a checkpoint directory, or the exported file
    checkpoint: Path  # the checkpoint directory, or the exported file
    config: dict[str, Any]  # the run config it was trained with, as a dict
    contract: dict[str, Any]  # its tokenizer's (Tokenizer.contract)
    tokenizer: Path | None  # a copy of its SentencePiece model, where one is found
    kind: str  # checkpoint | averaged | export
    step: int
    where: str  # for messages: the file the config and contract came from


def locate(path: str | Path) -> Located:
    """The model at `path`: a run_dir (its latest valid checkpoint), a pointer (RUN/best,
    RUN/latest), a step or averaged directory, or FILE.safetensors from `aiayn export`;
    checkpoint directories verified against their manifest's checksums."""
    from aiayn.checkpoint.tools import export_paths, read_export

    path = Path(path)
    if path.suffix == ".safetensors" and path.is_file():
        raw, tokenizer, contract = read_export(path)
        with safe_open(path, framework="pt") as fh:
            step = int((fh.metadata() or {}).get("aiayn_step", 0))
        _, config_file, _ = export_paths(path)
        return Located(path, path, raw, contract, tokenizer, "export", step, str(config_file))
    ckpt = resolve_checkpoint(path)  # verified
    manifest = read_manifest(ckpt, verify=False)
    kind = "checkpoint" if TRAINER_FILE in manifest["files"] else "averaged"
    tokenizer = tokenizer_file(ckpt, manifest)
    return Located(
        ckpt / MODEL_FILE,
        ckpt,
        manifest["config"],
        manifest["tokenizer"],
        tokenizer,
        kind,
        int(manifest["step"]),
        f"{ckpt}/{MANIFEST_FILE}",
    )


# ---- the record ---------------------------------------------------------------------------


def fingerprint(found: Located) -> str:
    """sha256 of what pins the source's weights: a checkpoint's manifest (which holds every
    file's checksum), or the exported file itself."""
    return sha256_of(
        found.checkpoint / MANIFEST_FILE if found.checkpoint.is_dir() else found.weights
    )


def describe(given: str, found: Located) -> dict[str, Any]:
    """What a run records of its source (RUN/init_source.json, each checkpoint's manifest)."""
    return {
        "given": given,
        "path": str(found.checkpoint.resolve()),
        "kind": found.kind,
        "step": found.step,
        "sha256": fingerprint(found),
        "model": found.config["model"],
        "tokenizer": found.config.get("tokenizer", {}),
        "config": found.config,  # the rest of the source's settings, to log what differs
        "tokenizer_contract": found.contract,
        "reset": ["step", "schedule", "optimizer", "data position", "rng", "best", "loss scale"],
    }


def recorded(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(
            f"{path} is not readable JSON ({exc}): it records where this run started from. "
            "Restore it, or start a new run_dir"
        ) from None


def resolve(given: str, run_dir: Path) -> tuple[Located, dict[str, Any]]:
    """The source a start without a checkpoint of its own loads, and its record: the recorded
    one where an earlier start wrote it (checked unchanged), else `given`, resolved now and
    recorded. Rank 0's work (train.py broadcasts its answer)."""
    before = recorded(run_dir)
    if before is None:
        found = locate(_imported(given, Path(run_dir)) or given)
        record = describe(given, found)
        write_atomic(Path(run_dir) / RECORD, json.dumps(record, indent=1) + "\n")
        return found, record
    if before["given"] != given:
        raise CheckpointError(
            f"{run_dir} was started from init.source={before['given']} ({before['path']}), "
            f"not {given}: a run_dir belongs to one source. Use a new run_dir, or "
            f"init.source={before['given']}"
        )
    path = Path(before["path"])
    try:  # the recorded checkpoint itself: RUN/latest is not looked up again
        found = locate(path) if path.exists() else None
    except CheckpointError as exc:
        raise CheckpointError(
            f"the source this run started from cannot be read: {exc} (init.source={given}, "
            f"recorded in {run_dir / RECORD}). The run has no checkpoint of its own yet, so it "
            "needs that source: restore it, or start a new run_dir"
        ) from None
    if found is None:
        raise CheckpointError(
            f"the source this run started from is gone: {path} (init.source={given}, recorded "
            f"in {run_dir / RECORD}). The run has no checkpoint of its own yet, so it needs "
            "that source: restore it, or start a new run_dir"
        )
    if fingerprint(found) != before["sha256"]:
        raise CheckpointError(
            f"the source this run started from has changed: {path} no longer has the sha256 "
            f"recorded in {run_dir / RECORD}. The run has no checkpoint of its own yet: "
            "restore the source, or start a new run_dir"
        )
    return found, before


def _imported(given: str, run_dir: Path) -> Path | None:
    """A Hugging Face MarianMT directory (or hub name) imported once into the run (as `aiayn
    import-hf` does), which is then the source the record pins; None for aiayn's own."""
    from aiayn.export.hf_import import import_hf, is_hf_model

    if not is_hf_model(given):
        return None
    out = run_dir / "init_source" / "imported.safetensors"
    if not out.is_file():  # a start killed after the import finds it done
        log.info("init.source=%s: a Hugging Face model, imported into %s", given, out)
        import_hf(given, out)
    return out


def check_resumed(given: str | None, manifest: dict[str, Any], ckpt: Path) -> None:
    """A run resuming its own checkpoint `ckpt` with init.source=`given`: refused where the
    checkpoint was started from another source, or from none."""
    if given is None:
        return
    init = manifest.get("init")
    if init is None:
        raise CheckpointError(
            f"{ckpt.parent.parent} holds checkpoints of a run trained from scratch, not from "
            f"init.source={given}: use a new run_dir for the fine-tune (or drop init.source to "
            "resume that run)"
        )
    if init["given"] != given:
        raise CheckpointError(
            f"{ckpt.parent.parent} holds checkpoints started from init.source={init['given']} "
            f"({init['path']}), not {given}: use a new run_dir, or init.source={init['given']}"
        )


# ---- what the source decides ---------------------------------------------------------------


def shaped_by_source(model: dict[str, Any]) -> tuple[str, ...]:
    """The model fields the source decides: its architecture, and the position table's length
    where positions are learned (a sinusoid table extends to any length)."""
    return ARCHITECTURE_FIELDS + (("max_len",) if model.get("positions") == "learned" else ())


def with_source(cfg, record: dict[str, Any], explicit: frozenset[str] | None):
    """`cfg` with the model's shape and the tokenizer section taken from the source, unless
    set (`explicit`: the keys the config file and overrides set; None: the fields whose value
    differs from the default count as set). A field set to another value than the source's is
    an error naming it and both values. Returns (config, lines saying what differs)."""
    from aiayn.config import ModelConfig, config_from_dict

    source_model = record["model"]
    default = dataclasses.asdict(ModelConfig())
    raw = cfg.to_dict()
    ours = raw["model"]

    def is_set(key: str) -> bool:
        if explicit is not None:
            return f"model.{key}" in explicit
        return ours[key] != default[key]

    conflicts, model = [], dict(ours)
    for key in shaped_by_source(source_model):
        if key not in source_model:
            continue
        if is_set(key) and ours[key] != source_model[key]:
            conflicts.append(
                f"model.{key}: init.source has {source_model[key]!r}, this config {ours[key]!r}"
            )
        model[key] = source_model[key]
    if conflicts:
        raise ConfigError(
            f"init.source={record['given']} was trained with another model shape:\n  "
            + "\n  ".join(conflicts)
            + "\nRemove these keys from the config (the source's are used), or start from "
            "scratch without init.source"
        )
    notes = [
        f"model.{key}: {source_model[key]!r} in the source, {ours[key]!r} here"
        for key in ("dropout", "attention_dropout")
        if key in source_model and source_model[key] != ours[key]
    ]
    for section, keys in SETTINGS.items():
        theirs = record.get("config", {}).get(section, {})
        for key in keys or raw[section]:
            if key in theirs and theirs[key] != raw[section].get(key):
                notes.append(
                    f"{section}.{key}: {theirs[key]!r} in the source, {raw[section][key]!r} here"
                )
    raw["model"] = {k: v for k, v in model.items() if k != "preset"}
    if cfg.init.vocab == "same":  # the source's tokenizer, copied: its settings trained it
        raw["tokenizer"] = {**record["tokenizer"], "path": cfg.tokenizer.path}
    return config_from_dict(raw, source="the config with init.source's model"), notes


def bring_tokenizer(cfg, found: Located, record: dict[str, Any]) -> None:
    """The source's tokenizer at the run's tokenizer path: copied there where tokenizer.path is
    not set and no copy is there yet; otherwise the file there must be the source's (its
    contract's fields named where not). Rank 0's work, before the tokenizer is opened."""
    path = cfg.tokenizer_path
    where = f"init.source={record['given']} ({record['path']})"
    if not path.is_file():
        if cfg.tokenizer.path is not None:
            raise ConfigError(
                f"tokenizer.path {path} does not exist: leave tokenizer.path unset to use "
                f"{where}'s tokenizer (copied into the run), or name its file"
            )
        if found.tokenizer is None:
            raise CheckpointError(
                f"the tokenizer {where} was trained with is not found (its sha256 matches no "
                "file beside the checkpoint or at its config's tokenizer.path): set "
                "tokenizer.path to it"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        shutil.copyfile(found.tokenizer, tmp)
        tmp.replace(path)
        log.info("tokenizer: %s's, copied to %s", where, path)
    check_contract(record["tokenizer_contract"], Tokenizer(path), where=where)


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
        raise CheckpointError(
            f"init.optimizer=keep takes Adam's moments from a training checkpoint, and "
            f"{found.checkpoint} is an {'export' if found.kind == 'export' else 'averaged model'}"
            ", which holds weights only: name one of the run's checkpoints, or set "
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
    saved = reshard.Topology.of_checkpoint(manifest, trainer_state)
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


def log_start(record: dict[str, Any], notes: list[str]) -> None:
    log.info(
        "init.source=%s: the weights of %s (%s, step %d, sha256 %s); step, schedule, "
        "optimizer, data position, random state and best ranking start fresh",
        record["given"],
        record["path"],
        record["kind"],
        record["step"],
        record["sha256"][:12],
    )
    for note in notes:
        log.info("init.source: %s (this config's is used)", note)


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """The record without the model and tokenizer sections the config already holds: what a
    checkpoint's manifest and TensorBoard's hparams keep."""
    drop = ("model", "tokenizer", "tokenizer_contract", "config")
    return {k: v for k, v in record.items() if k not in drop}
