"""The DeepSpeed config, generated from the run config so the two can never disagree.

Everything DeepSpeed needs to know about the step is derived here: accumulation, clipping,
precision, ZeRO stage and offload, the optimizer. The paper's schedule is not a DeepSpeed
scheduler; the engine hands DeepSpeed our own (`schedule.learning_rate`) as a callable, and
DeepSpeed steps it once per optimizer step. A user may add keys from a JSON file
(`distributed.deepspeed_config`, e.g. `configs/deepspeed/*.json`): new keys are merged in, a
key that contradicts a generated value is an error naming both values.

What DeepSpeed reports about itself (`REPORTING`: its throughput timer, per-phase timers and
progress lines) is no copy of the run config but a choice of diagnostics: aiayn turns it off,
because on a GPU its timers make the host wait for the device at every micro-batch, and a
user's file may turn it back on: there the file's values win, merged into ours. The
diagnostics a merged config turns on that wait for the device are logged at start
(`device_waits`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from aiayn.config import Config
from aiayn.engine import deepspeed_files
from aiayn.engine.kind import Kind
from aiayn.errors import ConfigError

log = logging.getLogger("aiayn")


def problems(cfg: Config) -> list[str]:
    """The run config's settings that DeepSpeed cannot run together."""
    par, errs = cfg.distributed, []
    if par.offload_optimizer and par.zero_stage < 1:
        errs.append("distributed.offload_optimizer needs distributed.zero_stage >= 1")
    if par.offload_params and par.zero_stage != 3:
        errs.append("distributed.offload_params needs distributed.zero_stage=3")
    if cfg.train.compile:
        errs.append(
            "train.compile is not for distributed.backend deepspeed: DeepSpeed's hooks gather "
            "and reduce inside the layers torch.compile would trace; set train.compile=false "
            "or choose another distributed.backend"
        )
    return errs


KIND = Kind(
    name="deepspeed",
    title="DeepSpeed",
    build="aiayn.engine.deepspeed_engine:DeepSpeedEngine",
    options=("zero_stage", "offload_optimizer", "offload_params", "deepspeed_config"),
    check=problems,
    layout=lambda distributed: f"ZeRO-{distributed.get('zero_stage', 0)}",
    shard_rank=deepspeed_files.partition_rank,
    portable=deepspeed_files.read,
)

# The top-level keys of DeepSpeed's reports about itself: a user's file may change them.
REPORTING = ("timers", "wall_clock_breakdown", "steps_per_print")


def generate(cfg: Config, world_size: int, device_type: str) -> dict[str, Any]:
    """The DeepSpeed config this run implies, before any user file is merged."""
    par, train, optim = cfg.distributed, cfg.train, cfg.optim
    zero: dict[str, Any] = {"stage": par.zero_stage}
    if par.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if par.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    ds: dict[str, Any] = {
        # Batches are measured in tokens, not sequences: DeepSpeed's "micro-batch" is one of
        # our token-budget batches, so its batch-size arithmetic holds and means "batches".
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": train.accumulation(world_size),
        "train_batch_size": train.accumulation(world_size) * world_size,
        # The loop owns the accumulation boundary: it calls step() once per optimizer step,
        # after all micro-batches, as it does for DDP.
        "managed_gradient_accumulation": False,
        # At stage 0 DeepSpeed steps a plain torch optimizer and computes no gradient norm;
        # DeepSpeedEngine then clips (and measures the norm) itself, after the all-reduce.
        "gradient_clipping": 0.0 if plain_optimizer(cfg) else train.clip_norm,
        "optimizer": {
            "type": "AdamW" if optim.name == "adamw" else "Adam",
            "params": {
                "lr": 1.0,  # the scheduler's factor is the learning rate, as in LocalEngine
                "betas": list(optim.betas),
                "eps": optim.eps,
                "weight_decay": optim.weight_decay,
                # DeepSpeed's "Adam" decouples weight decay unless told otherwise.
                "adam_w_mode": optim.name == "adamw",
                **adam_implementation(cfg, device_type),
            },
        },
        "zero_optimization": zero,
        # DeepSpeed's reports about itself (REPORTING), all off: train/report.py measures
        # tokens/s and the step's numbers without waiting for the device. The throughput
        # timer is on by default and synchronizes the device when it starts, at every
        # forward (each micro-batch), and when it stops, at every step.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        # Per-phase timers (forward, backward, reduce, step): CUDA events read back each step.
        "wall_clock_breakdown": False,
        "steps_per_print": 2**31 - 1,  # our own logging reports every step's numbers
    }
    if train.precision == "bf16":
        # Autocast with fp32 weights, as the DDP engine does: the same numerics either way.
        # DeepSpeed would also reduce (and ZeRO-3 gather) the weights of the modules it deems
        # safe in bf16, nn.Linear's, gradients included; DDP reduces fp32 gradients. No module
        # on that list keeps every reduction in fp32, as DDP's: twice the bytes of a bf16
        # reduction, and the same updates.
        ds["torch_autocast"] = {
            "enabled": True,
            "dtype": "bfloat16",
            "lower_precision_safe_modules": [],
        }
    elif train.precision == "fp16":
        # fp16 weights with fp32 master copies and dynamic loss scaling (loss_scale 0).
        power = round(math.log2(train.loss_scale_init))  # a power of two (config/schema.py)
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": power}
    return ds


def adam_implementation(cfg: Config, device_type: str) -> dict[str, Any]:
    """Which Adam DeepSpeed builds: torch's, as the recipe's for the other engines, except
    with CPU offload, which steps its own DeepSpeedCPUAdam (compiled with a C++ compiler).

    Left to itself DeepSpeed takes its FusedAdam on CUDA: an op compiled with nvcc inside
    deepspeed.initialize (every rank stops where CUDA_HOME is missing), whose state holds
    'step' as an int where torch's holds a float tensor. torch's fused kernel does the same
    update, with nothing to compile; DeepSpeed passes "fused" on to torch.optim.Adam(W).
    """
    if cfg.distributed.offload_optimizer:
        return {"torch_adam": False}
    fused = device_type in ("cpu", "cuda")
    return {"torch_adam": True, "fused": fused or None, "foreach": None if fused else True}


def plain_optimizer(cfg: Config) -> bool:
    """True where DeepSpeed steps the torch optimizer itself, with no ZeRO or fp16 wrapper."""
    return cfg.distributed.zero_stage == 0 and cfg.train.precision != "fp16"


def merge(generated: dict[str, Any], extra: dict[str, Any], source: str) -> dict[str, Any]:
    """`generated` with the keys of `extra` added; contradictions are collected and raised,
    but under the REPORTING keys, where `extra`'s values win."""
    conflicts: list[str] = []
    merged = _merge(generated, extra, "", conflicts)
    if conflicts:
        raise ConfigError(
            f"{source} contradicts the DeepSpeed config generated from the run config:\n  "
            + "\n  ".join(conflicts)
            + "\nSet these through the run config (train.*, optim.*, distributed.*) and remove "
            "them from the JSON file."
        )
    return merged


def _merge(base: dict, extra: dict, prefix: str, conflicts: list[str], wins: bool = False) -> dict:
    out = dict(base)
    for key, value in extra.items():
        where = f"{prefix}{key}"
        extra_wins = wins or (not prefix and key in REPORTING)
        if key not in base:
            out[key] = value
        elif isinstance(base[key], dict) and isinstance(value, dict):
            out[key] = _merge(base[key], value, f"{where}.", conflicts, extra_wins)
        elif base[key] != value:
            if extra_wins:
                out[key] = value
            else:
                conflicts.append(
                    f"{where}: file says {value!r}, the run config gives {base[key]!r}"
                )
    return out


def device_waits(ds: dict[str, Any]) -> list[str]:
    """DeepSpeed's diagnostics that `ds` turns on and that make the host wait for the device
    (read as DeepSpeed 0.19 reads them, its defaults where a key is absent)."""
    waits = []
    throughput = ds.get("timers", {}).get("throughput", {})
    if throughput.get("enabled", True) and throughput.get("synchronized", True):
        waits.append("timers.throughput.synchronized: a device sync at every forward and step")
    if ds.get("wall_clock_breakdown") or ds.get("flops_profiler", {}).get("enabled"):
        waits.append(
            "wall_clock_breakdown (flops_profiler turns it on): timers read back from the device "
            "at every step"
        )
    if "comms_logger" in ds:
        # DeepSpeed's DeepSpeedCommsConfig: comms_logger_enabled = 'comms_logger' in ds_config.
        waits.append(
            "comms_logger (on wherever the key is, whatever its 'enabled' says): a device sync "
            "after every collective"
        )
    return waits


def build(cfg: Config, world_size: int, device_type: str) -> dict[str, Any]:
    """The generated config with the user's file (if any) merged in."""
    ds = generate(cfg, world_size, device_type)
    path = cfg.distributed.deepspeed_config
    if path is None:
        return ds
    if not Path(path).is_file():
        raise ConfigError(f"distributed.deepspeed_config: file not found: {path}")
    try:
        extra = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ConfigError(f"distributed.deepspeed_config {path} is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"distributed.deepspeed_config {path} must hold a JSON object")
    ds = merge(ds, extra, path)
    for wait in device_waits(ds):
        log.info("distributed.deepspeed_config %s turns on DeepSpeed's %s", path, wait)
    return ds
