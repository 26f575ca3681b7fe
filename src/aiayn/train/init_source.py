"""Starting a run from a trained model (`init.source`), at run start: resolving the source
and recording it in the run directory, the architecture and tokenizer it brings, and loading its
weights into the new model (checkpoint/locate.py finds a source's files, checkpoint/init_from.py
reads its weights and moments).

What a source can be, read as `aiayn translate` reads a checkpoint (`locate`): a run directory
(its latest valid checkpoint, or RUN/best, RUN/latest, RUN/averaged), a step directory, an
averaged model, a FILE.safetensors from `aiayn export`, or a Hugging Face MarianMT model,
imported once into the run.

Restarts never re-initialise, by this order (`starting_point` applies it):
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

from aiayn.checkpoint.format import ARCHITECTURE_FIELDS, ema_of, read_manifest
from aiayn.checkpoint.init_from import load_weights
from aiayn.checkpoint.locate import Located, exists, fingerprint, locate
from aiayn.config import Config
from aiayn.distributed.env import DistEnv
from aiayn.errors import CheckpointError, ConfigError
from aiayn.export.hf_import import import_hf, is_hf_model
from aiayn.runtime.durable import write_atomic
from aiayn.tokenizer import Tokenizer, check_contract

log = logging.getLogger(__name__)

RECORD = "init_source.json"  # in run_dir, written at the first start
# Settings outside the model whose change a fine-tune's log reports (None: the whole section).
SETTINGS = {
    "data": ["train"],
    "train": [
        "max_tokens",
        "tokens_per_step",
        "grad_accum",
        "label_smoothing",
        "clip_norm",
        "precision",
    ],
    "schedule": None,
    "optim": None,
}


# ---- the record ---------------------------------------------------------------------------


def describe(given: str, found: Located) -> dict[str, Any]:
    """What a run records of its source (RUN/init_source.json, each checkpoint's manifest)."""
    return {
        "given": given,
        "path": str(found.name.resolve()),  # CKPT/ema for its train.ema weights
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
        found = locate(path) if exists(path) else None
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
    if not is_hf_model(given) or (ema_of(given) is not None and exists(Path(given))):
        return None  # RUN/ema of a local run: one slash reads like a hub name
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


@dataclass
class Start:
    """Where a run with init.source starts: the source's files (None when the run resumes its
    own checkpoint) and what every checkpoint records of it."""

    found: Located | None
    provenance: dict


def starting_point(
    cfg: Config, explicit: frozenset[str] | None, resume_from: Path | None, env: DistEnv
) -> tuple[Config, Start]:
    """init.source's part of a start, in the order this module's docstring gives: the
    config with the source's model and tokenizer, and what to load."""
    given, run_dir = cfg.init.source, Path(cfg.run_dir)
    if resume_from is not None:  # the run's own checkpoint wins; the source is not read
        manifest = read_manifest(resume_from, verify=False)  # verified by resume_point
        check_resumed(given, manifest, resume_from)
        saved = {"given": given, **manifest["config"]}
        cfg, _ = with_source(cfg, saved, explicit)
        log.info(
            "init.source=%s not loaded: the run resumes its own checkpoint %s", given, resume_from
        )
        return cfg, Start(None, manifest["init"])

    def resolved():
        found, record = resolve(given, run_dir)
        merged, notes = with_source(cfg, record, explicit)
        if cfg.init.vocab == "same":
            bring_tokenizer(merged, found, record)
        elif found.tokenizer is None:
            raise CheckpointError(
                f"init.vocab=remap maps pieces by string, but the tokenizer {given} was "
                "trained with is not found beside it or at its config's tokenizer.path"
            )
        return found, record, merged, notes

    # Rank 0 resolves, records and copies the tokenizer; every rank gets its answer.
    found, record, cfg, notes = env.decide(resolved)
    if env.is_main:
        log_start(record, notes)
    return cfg, Start(found, summary(record))


def load_source(model, start: Start, cfg: Config, tok: Tokenizer, env: DistEnv) -> None:
    """init.source's weights into the plain model, and what that did in the log and record."""
    remap = (Tokenizer(start.found.tokenizer), tok) if cfg.init.vocab == "remap" else None
    counts = load_weights(model, start.found, cfg.init.exclude, remap)
    start.provenance |= {"exclude": list(cfg.init.exclude), "vocab": cfg.init.vocab, **counts}
    if not env.is_main:
        return
    if cfg.init.exclude:
        log.info("init.exclude: %s values left freshly initialised", f"{counts['fresh']:,}")
    if remap is not None:
        log.info(
            "init.vocab=remap: %d of this tokenizer's %d pieces taken from the source's %d by "
            "string (the 4 specials by role), %d new",
            counts["pieces_kept"],
            tok.vocab_size,
            remap[0].vocab_size,
            counts["pieces_new"],
        )
