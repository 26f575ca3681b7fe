"""Finding a trained model's files: a run directory's latest valid checkpoint, a pointer
(RUN/best, RUN/latest), a step or averaged directory, or an exported FILE.safetensors, with its
config, tokenizer contract and tokenizer. What inference and init.source both read."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from safetensors import safe_open

from aiayn.checkpoint.format import (
    EMA,
    EMA_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    TRAINER_FILE,
    ema_of,
    ema_weights,
    read_manifest,
    resolve_checkpoint,
    tokenizer_file,
)
from aiayn.errors import CheckpointError
from aiayn.runtime.durable import sha256_of


@dataclass(frozen=True)
class Located:
    """A trained model's files: what load_for_inference and init.source both read."""

    weights: Path  # model.safetensors of a checkpoint directory, or the exported file
    checkpoint: Path  # the checkpoint directory, or the exported file
    config: dict[str, Any]  # the run config it was trained with, as a dict
    contract: dict[str, Any]  # its tokenizer's (Tokenizer.contract)
    tokenizer: Path | None  # a copy of its SentencePiece model, where one is found
    kind: str  # checkpoint | averaged | export | ema (a checkpoint's train.ema weights)
    step: int
    where: str  # for messages: the file the config and contract came from

    @property
    def name(self) -> Path:
        """What names these weights again: the checkpoint, or CKPT/ema for its EMA."""
        return self.checkpoint / EMA if self.kind == EMA else self.checkpoint


def exists(path: Path) -> bool:
    """Whether `path` names weights that are there to locate (CKPT/ema: its checkpoint)."""
    parent = ema_of(path)
    return (parent or path).exists()


def locate(path: str | Path) -> Located:
    """The model at `path`: a run_dir (its latest valid checkpoint), a pointer (RUN/best,
    RUN/latest), a step or averaged directory, or FILE.safetensors from `aiayn export`; any
    of those but the last followed by /ema for its train.ema weights (RUN/ema). Checkpoint
    directories verified against their manifest's checksums."""
    from aiayn.checkpoint.average import export_paths, read_export

    path = Path(path)
    parent = ema_of(path)
    if parent is not None:
        return _ema(parent)
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


def _ema(path: Path) -> Located:
    """The train.ema weights of the checkpoint `path` resolves to."""
    found = locate(path)
    if found.kind == "export":
        raise CheckpointError(f"{found.checkpoint} is an export: it holds no {EMA_FILE}")
    weights = ema_weights(found.checkpoint, read_manifest(found.checkpoint, verify=False))
    return replace(found, weights=weights, kind=EMA, where=f"{found.where} ({EMA_FILE})")


def fingerprint(found: Located) -> str:
    """sha256 of what pins the source's weights: a checkpoint's manifest (which holds every
    file's checksum), or the exported file itself."""
    return sha256_of(
        found.checkpoint / MANIFEST_FILE if found.checkpoint.is_dir() else found.weights
    )
