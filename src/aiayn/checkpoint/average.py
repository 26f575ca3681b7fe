"""Checkpoints made from checkpoints: averaging, and export to one safetensors file.

Averaging the weights of the last checkpoints of a run is how the paper reports its results
(§6.1: the last 5 checkpoints for the base model, the last 20 for the big one). It reads each
checkpoint's consolidated `model.safetensors` tensor by tensor through `safe_open`, so memory
holds the running sum and one tensor: about two copies of the model, however many are averaged.

An export is one safetensors file of the weights (fp32 or bf16) with the run's config and
tokenizer beside it:

    FILE.safetensors          weights (tied matrices stored once), the tokenizer contract and
                              step in its metadata
    FILE.config.yaml          the run's resolved config
    FILE.tokenizer.model      the SentencePiece model

It needs nothing of the trainer (no optimizer state, no DeepSpeed) to load:
`aiayn.checkpoint.inference.load_for_inference(FILE.safetensors)`, or `aiayn translate --checkpoint
FILE.safetensors`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from aiayn.checkpoint.format import (
    ARCHITECTURE_FIELDS,
    CHECKPOINTS_DIR,
    EMA,
    EMA_FILE,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    checkpoints_in,
    ema_of,
    ema_weights,
    read_manifest,
    resolve_checkpoint,
    step_of,
    tokenizer_file,
)
from aiayn.engine.ema import UPDATES_KEY
from aiayn.engine.state import weights_snapshot
from aiayn.errors import CheckpointError
from aiayn.runtime.durable import fsync_path, sha256_of, write_atomic
from aiayn.tokenizer import Tokenizer

log = logging.getLogger("aiayn")

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- averaging ----------------------------------------------------------------------------


def collect(sources: list[str | Path], last: int | None = None) -> list[Path]:
    """The checkpoints named by `sources` (step dirs, run dirs or their checkpoints/ folders),
    oldest first, verified; the newest `last` of them if given."""
    found: dict[Path, None] = {}
    for source in map(Path, sources):
        if (source / MANIFEST_FILE).is_file():
            read_manifest(source)  # named explicitly: a corrupt one is an error
            found[source.resolve()] = None
            continue
        for root in (source / CHECKPOINTS_DIR, source):  # a run_dir, or its checkpoints/
            ckpts = checkpoints_in(root)
            if ckpts:
                break
        else:
            raise CheckpointError(
                f"no checkpoints at {source}: pass run dirs holding checkpoints/ or "
                "checkpoints/step_XXXXXXXX directories"
            )
        for ckpt in ckpts:
            try:
                read_manifest(ckpt)
                found[ckpt.resolve()] = None
            except CheckpointError as exc:  # a run's broken checkpoint is left out, not fatal
                log.warning("leaving out checkpoint %s: %s", ckpt, exc)
    ckpts = sorted(found, key=lambda p: (step_of(p), str(p)))
    if last is not None:
        if last < 1 or last > len(ckpts):
            raise CheckpointError(
                f"--last {last}: there are {len(ckpts)} valid checkpoints "
                f"({', '.join(p.name for p in ckpts)}); keep more with checkpoint.keep_last or "
                "checkpoint.keep_every, or average fewer"
            )
        ckpts = ckpts[-last:]
    return ckpts


def check_same_model(manifests: dict[Path, dict[str, Any]]) -> None:
    """Raise naming every architecture or tokenizer field where the checkpoints differ."""
    (first, ref), *others = manifests.items()
    diffs = []
    for path, manifest in others:
        model, ref_model = manifest["config"]["model"], ref["config"]["model"]
        diffs += [
            f"model.{k}: {ref_model.get(k)!r} in {first}, {model.get(k)!r} in {path}"
            for k in ARCHITECTURE_FIELDS
            if model.get(k) != ref_model.get(k)
        ]
        tok, ref_tok = manifest["tokenizer"], ref["tokenizer"]
        diffs += [
            f"tokenizer {k}: {ref_tok.get(k)!r} in {first}, {tok.get(k)!r} in {path}"
            for k in sorted(set(tok) | set(ref_tok))
            if tok.get(k) != ref_tok.get(k)
        ]
    if diffs:
        raise CheckpointError(
            "these checkpoints belong to different models and cannot be averaged:\n  "
            + "\n  ".join(diffs)
            + "\nAverage checkpoints of one run, or of runs with the same model and tokenizer."
        )


def average_weights(
    ckpts: list[Path], name: str = MODEL_FILE
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Mean of each tensor of the file `name` over `ckpts` (summed in fp32 in the given order,
    then cast back); and the first file's metadata (which names tied tensors stored once)."""
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(c / name, framework="pt")) for c in ckpts]
        keys = set(files[0].keys())
        for ckpt, fh in zip(ckpts[1:], files[1:], strict=True):
            if set(fh.keys()) != keys:
                odd = sorted(keys ^ set(fh.keys()))[:5]
                raise CheckpointError(
                    f"{ckpt} holds other tensors than {ckpts[0]} ({odd}): not the same model"
                )
        averaged = {}
        for key in sorted(keys):
            first = files[0].get_tensor(key)
            if not first.is_floating_point():  # counters, ids: must agree, are not averaged
                for ckpt, fh in zip(ckpts[1:], files[1:], strict=True):
                    if not torch.equal(fh.get_tensor(key), first):
                        raise CheckpointError(f"{key} differs between {ckpts[0]} and {ckpt}")
                averaged[key] = first
                continue
            total = first.to(torch.float32, copy=True)
            for ckpt, fh in zip(ckpts[1:], files[1:], strict=True):
                tensor = fh.get_tensor(key)
                if tensor.shape != first.shape:
                    raise CheckpointError(
                        f"{key} has shape {tuple(tensor.shape)} in {ckpt} and "
                        f"{tuple(first.shape)} in {ckpts[0]}: not the same model"
                    )
                total += tensor
            averaged[key] = total.div_(len(ckpts)).to(first.dtype)
        return averaged, files[0].metadata() or {}


def average(sources: list[str | Path], output: str | Path, last: int | None = None) -> Path:
    """Average checkpoints into a new checkpoint directory `output` (written atomically) that
    translate and evaluate load like any other. Where every one holds train.ema's weights,
    their average is `output`'s (OUTPUT/ema). Returns its path."""
    ckpts = collect(sources, last)
    manifests = {c: read_manifest(c, verify=False) for c in ckpts}  # collect() verified them
    check_same_model(manifests)
    output = Path(output)
    _refuse_existing(output)
    newest = manifests[ckpts[-1]]
    log.info("averaging %d checkpoints: %s", len(ckpts), ", ".join(str(c) for c in ckpts))
    tensors, metadata = average_weights(ckpts)
    tmp = output.parent / f".tmp-{output.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / MODEL_FILE), metadata=metadata)
        del tensors
        names = [MODEL_FILE]
        if _average_ema(ckpts, manifests, tmp / EMA_FILE):
            names.append(EMA_FILE)
        if _copy_tokenizer(ckpts[-1], newest, tmp / TOKENIZER_FILE):
            names.append(TOKENIZER_FILE)
        manifest = {
            "format": FORMAT_VERSION,
            "step": newest["step"],
            "files": _seal(tmp, names),
            "config": newest["config"],
            "tokenizer": newest["tokenizer"],
            "averaged_from": [
                {
                    "checkpoint": str(c),
                    "step": m["step"],
                    # One sha256, or each byte range's where the ranks wrote it by range.
                    **{
                        k: v
                        for k, v in m["files"][MODEL_FILE].items()
                        if k in ("sha256", "sha256_ranges")
                    },
                }
                for c, m in manifests.items()
            ],
        }
        write_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1))
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(output.parent)
    return output


def _average_ema(ckpts: list[Path], manifests: dict[Path, dict[str, Any]], out: Path) -> bool:
    """The average of the checkpoints' train.ema weights into `out`, where all hold them
    (a smoothed model averaged again: "EMA averaged" in docs/recipes.md). Whether written."""
    without = [c for c in ckpts if EMA_FILE not in manifests[c]["files"]]
    if without:
        if len(without) < len(ckpts):
            log.info("not averaging the EMA of the weights: %s holds none", without[0])
        return False
    tensors, metadata = average_weights(ckpts, EMA_FILE)
    metadata.pop(UPDATES_KEY, None)  # an average is weights only: no EMA goes on from it
    save_file(tensors, str(out), metadata=metadata)
    return True


# ---- export -------------------------------------------------------------------------------


def export_paths(weights: str | Path) -> tuple[Path, Path, Path]:
    """(weights, config, tokenizer) paths of an export named FILE.safetensors."""
    weights = Path(weights)
    stem = weights.with_suffix("")
    return weights, Path(f"{stem}.config.yaml"), Path(f"{stem}.tokenizer.model")


def export(source: str | Path, output: str | Path, dtype: str = "fp32") -> Path:
    """Write the weights of `source` (a step dir, or a run dir's latest valid checkpoint) to
    one safetensors file, its config and tokenizer beside it. Returns the weights' path."""
    weights, _, tokenizer = _export_targets(output, dtype)
    ema = ema_of(source)  # RUN/ema: the checkpoint's train.ema weights
    ckpt = resolve_checkpoint(ema or source)
    manifest = read_manifest(ckpt, verify=False)  # resolve_checkpoint verified it
    stored = ckpt / MODEL_FILE if ema is None else ema_weights(ckpt, manifest)
    weights.parent.mkdir(parents=True, exist_ok=True)
    tmp_tok = weights.parent / f".{tokenizer.name}.tmp"
    if not _copy_tokenizer(ckpt, manifest, tmp_tok):
        raise CheckpointError(
            f"the tokenizer {ckpt} was trained with is not found: pass the run's tokenizer "
            "with tokenizer.path=... in the checkpoint's config, or restore the file"
        )
    with safe_open(stored, framework="pt") as fh:
        metadata = dict(fh.metadata() or {})
    return _write_export(
        weights,
        load_file(stored),
        metadata,
        dtype,
        manifest["config"],
        tmp_tok,
        {
            "step": manifest["step"],
            "tokenizer": manifest["tokenizer"],
            "source": str(ckpt if ema is None else ckpt / EMA),
        },
    )


def export_module(
    model: torch.nn.Module,
    config: dict[str, Any],
    tokenizer: Tokenizer,
    output: str | Path,
    dtype: str = "fp32",
    step: int = 0,
    source: str = "in memory",
) -> Path:
    """Write a model held in memory (built from `config`, a run config as a dict, with
    `tokenizer`) as `export` writes a checkpoint: for models made in code, such as the random
    ones the export tests and benchmarks use."""
    weights, _, tokenizer_dest = _export_targets(output, dtype)
    weights.parent.mkdir(parents=True, exist_ok=True)
    tmp_tok = weights.parent / f".{tokenizer_dest.name}.tmp"
    shutil.copyfile(tokenizer.path, tmp_tok)
    tensors, tied = weights_snapshot(model)
    info = {"step": step, "tokenizer": tokenizer.contract(), "source": source}
    return _write_export(weights, tensors, tied or {}, dtype, config, tmp_tok, info)


def _export_targets(output: str | Path, dtype: str) -> tuple[Path, Path, Path]:
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose from {sorted(EXPORT_DTYPES)}")
    paths = export_paths(output)
    if paths[0].suffix != ".safetensors":
        raise CheckpointError(f"--output {output}: name the file FILE.safetensors")
    for path in paths:
        _refuse_existing(path)
    return paths


def _write_export(
    weights: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    dtype: str,
    config: dict[str, Any],
    tmp_tokenizer: Path,
    info: dict[str, Any],
) -> Path:
    """The three files of an export, the weights last: their presence means all are there."""
    _, config_path, tokenizer = export_paths(weights)
    with open(tmp_tokenizer, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp_tokenizer, tokenizer)
    write_atomic(config_path, yaml.safe_dump(config, sort_keys=False))
    tensors = {
        k: t.to(EXPORT_DTYPES[dtype]) if t.is_floating_point() else t for k, t in tensors.items()
    }
    metadata = dict(metadata)
    metadata.update(
        aiayn_format=str(FORMAT_VERSION),
        aiayn_step=str(info["step"]),
        aiayn_dtype=dtype,
        aiayn_tokenizer=json.dumps(info["tokenizer"]),
        aiayn_source=info["source"],
    )
    tmp = weights.parent / f".{weights.name}.tmp"
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, weights)
    fsync_path(weights.parent)
    return weights


def read_export(weights: str | Path) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    """(config dict, tokenizer path, tokenizer contract) of an exported FILE.safetensors."""
    weights, config, tokenizer = export_paths(weights)
    for path in (config, tokenizer):
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: an export is {weights.name} with its .config.yaml and "
                ".tokenizer.model beside it (aiayn export writes all three)"
            )
    with safe_open(weights, framework="pt") as fh:
        metadata = fh.metadata() or {}
    if "aiayn_tokenizer" not in metadata:
        raise CheckpointError(f"{weights} was not written by aiayn export (no aiayn metadata)")
    raw = yaml.safe_load(config.read_text())
    return raw, tokenizer, json.loads(metadata["aiayn_tokenizer"])


# ---- helpers ------------------------------------------------------------------------------


def _refuse_existing(path: Path) -> None:
    if path.exists():
        raise CheckpointError(f"{path} exists: choose another --output, or delete it first")


def _copy_tokenizer(ckpt: Path, manifest: dict[str, Any], dest: Path) -> bool:
    """Copy the tokenizer `ckpt` was trained with to `dest` if found and matching its contract."""
    path = tokenizer_file(ckpt, manifest)
    if path is None:
        log.warning("the tokenizer of %s was not found or does not match; not copied", ckpt)
        return False
    shutil.copyfile(path, dest)
    with open(dest, "rb+") as fh:
        os.fsync(fh.fileno())
    return True


def _seal(tmp: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """fsync the files of a checkpoint being written; their sizes and checksums."""
    files = {}
    for name in names:
        with open(tmp / name, "rb+") as fh:
            os.fsync(fh.fileno())
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_of(tmp / name)}
    return files
