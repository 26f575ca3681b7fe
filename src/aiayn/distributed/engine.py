"""The engine: backward, clipping, optimizer and schedule, once per accumulation boundary.

The training loop only calls `backward`, `step`, `autocast` and the state methods, so a DDP or
DeepSpeed engine can take this one's place without the loop changing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR

from aiayn.config import Config
from aiayn.distributed import reshard
from aiayn.distributed.env import DistEnv
from aiayn.distributed.reshard import DEEPSPEED_DIR, Portable
from aiayn.errors import CheckpointError, ConfigError, TrainingError
from aiayn.model.layers import DecoderLayer, EncoderLayer
from aiayn.schedule import learning_rate

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _paper_schedule(optimizer: torch.optim.Optimizer, cfg: Config) -> LambdaLR:
    """The warmup schedule of §5.3 as a factor on lr=1.0, stepped once per optimizer step."""
    sched, d_model = cfg.schedule, cfg.model.d_model
    # LambdaLR's counter starts at 0 and the paper counts steps from 1.
    return LambdaLR(optimizer, lambda k: learning_rate(k + 1, sched, d_model))


def _checkpoint_layers(model: nn.Module, cfg: Config) -> None:
    """Turn on per-layer activation checkpointing in the model's layer stacks."""
    for m in model.modules():
        if hasattr(m, "checkpoint_layers"):
            m.checkpoint_layers = cfg.distributed.activation_checkpointing


def _compile_layers(model: nn.Module, cfg: Config) -> None:
    """torch.compile each encoder and decoder layer in place (train.compile).

    Layers, not the model: they are the repeated unit (one compiled graph serves all N), and
    the output projection after them runs on a data-dependent number of rows (the non-pad
    targets), which would break a whole-model graph. Compiling in place keeps the parameter
    names, so checkpoints load with or without it.
    """
    if not cfg.train.compile:
        return
    for m in model.modules():
        if isinstance(m, (EncoderLayer, DecoderLayer)):
            m.compile()


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """Adam with the paper's beta_2 = 0.98 and epsilon = 1e-9 (§5.3) unless configured."""
    cls = torch.optim.AdamW if cfg.optim.name == "adamw" else torch.optim.Adam
    params = [p for _, p in reshard.trainable(model)]
    # The fused kernel reads and writes each parameter, gradient and moment once per step; on
    # CPU, foreach falls back to one kernel per tensor and operation, about 3x slower
    # (benchmarks/README.md). Same update up to float rounding.
    fused = device.type in ("cpu", "cuda")
    # lr=1.0 so the LambdaLR factor *is* the learning rate.
    return cls(
        params,
        lr=1.0,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )


def clip_gradients(params, clip_norm: float) -> torch.Tensor:
    """Clip to `clip_norm` (0 turns clipping off) and return the norm from before clipping."""
    return nn.utils.clip_grad_norm_(params, clip_norm if clip_norm > 0 else float("inf"))


class LocalEngine:
    """One process, one device."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device):
        self.module = model.to(device)
        self.model = self.module  # what the loop calls; a wrapper (DDP) in other engines
        self.device = device
        self.clip_norm = cfg.train.clip_norm
        self.precision = cfg.train.precision
        self.optimizer = build_optimizer(self.module, cfg, device)
        self.scheduler = _paper_schedule(self.optimizer, cfg)
        # fp16 needs loss scaling; fp32 and bf16 do not, and a disabled scaler is a no-op.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.precision == "fp16")
        self.skipped_steps = 0
        _checkpoint_layers(self.module, cfg)
        _compile_layers(self.module, cfg)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def autocast(self):
        if self.precision in AUTOCAST:
            return torch.autocast(self.device.type, dtype=AUTOCAST[self.precision])
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def accumulating(self, last: bool):
        """Context for one micro-batch's forward and backward; `last` ends the step."""
        return contextlib.nullcontext()

    def replicas_differ(self, env: DistEnv) -> bool:
        """True if parameters differ between data-parallel ranks (a sanity check, nanotron's
        named-point style): one all-reduce of per-tensor sums, compared as min and max."""
        if not env.distributed:
            return False
        sums = torch.stack([p.detach().double().sum() for p in self.module.parameters()])
        low, high = sums.clone(), sums.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        return not torch.equal(low, high)

    def step(self) -> torch.Tensor:
        """Clip, step the optimizer and the schedule, clear gradients; return the grad norm.

        The norm stays a tensor so the caller decides when to pay for a host sync.
        """
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.module.parameters(), self.clip_norm)
        if self.scaler.is_enabled():
            # An overflowing fp16 step is skipped, schedule included, as DeepSpeed does: the
            # schedule counts applied updates. The scale's drop is the only public sign of it.
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:
                self.skipped_steps += 1
            else:
                self.scheduler.step()
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @contextlib.contextmanager
    def full_module(self):
        """The whole model with all its weights, on every rank (a collective where parameters
        are partitioned): for validation, decoding and writing model.safetensors."""
        yield self.module

    def save_shards(self, directory: Path) -> None:
        """Write this rank's share of the state into `directory` (nothing: rank 0's
        trainer state holds all of it)."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Restore from `state` (rank 0's trainer state) and, in sharded engines, this rank's
        shards in `checkpoint`. The weights are already loaded (`loads_weights`)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)

    def load_portable(self, state: Portable) -> None:
        """Restore from a checkpoint written on another topology (distributed/reshard.py)."""
        params = reshard.trainable(self.module)
        with torch.no_grad():
            for name, p in params:
                p.copy_(state.weights[name])
        _load_torch_adam(self.optimizer, params, state)
        _load_schedule(self.scheduler, state)
        self.skipped_steps = state.skipped_steps

    # The checkpoint's model.safetensors is loaded into `module` before load_state_dict.
    loads_weights = True


def _load_torch_adam(optimizer: torch.optim.Optimizer, params, state: Portable) -> None:
    """A torch Adam's state from `state`, indexed by position as its state_dict is."""
    saved = optimizer.state_dict()
    step = torch.tensor(float(state.step))  # torch's Adam keeps the step as a float tensor
    saved["state"] = {
        i: {"step": step.clone(), **{k: v.clone() for k, v in state.moments[name].items()}}
        for i, (name, _) in enumerate(params)
        if name in state.moments
    }
    optimizer.load_state_dict(saved)  # casts to each parameter's device and dtype


def _load_schedule(scheduler: LambdaLR, state: Portable) -> None:
    """The schedule's position, and the learning rate it had set at the checkpoint's step
    (LambdaLR.load_state_dict restores the counter, not the optimizer's lr)."""
    scheduler.load_state_dict(state.scheduler)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


class DDPEngine(LocalEngine):
    """PyTorch DistributedDataParallel: gradients all-reduced (averaged) in the backward pass."""

    def __init__(self, model: nn.Module, cfg: Config, env: DistEnv):
        super().__init__(model, cfg, env.device)
        ids = [env.device.index] if env.device.type == "cuda" else None
        self.model = DDP(self.module, device_ids=ids)  # broadcasts rank 0's parameters
        self.world_size = env.world_size

    def backward(self, loss: torch.Tensor) -> None:
        # The loop divides by the tokens of all ranks; DDP then averages over ranks, which
        # would divide a second time by the world size.
        (loss * self.world_size).backward()

    def accumulating(self, last: bool):
        # Gradients are all-reduced once per optimizer step, on its last micro-batch.
        return contextlib.nullcontext() if last else self.model.no_sync()


class DeepSpeedEngine:
    """DeepSpeed ZeRO stages 0-3 with optional CPU offload, behind the same interface.

    The DeepSpeed config comes from `deepspeed_config.build`, so the run config stays the one
    source of truth. DeepSpeed owns clipping, the optimizer and stepping the schedule (we hand
    it the paper's schedule as a callable); the loop keeps owning the accumulation boundary.
    """

    loads_weights = False  # the ZeRO shards hold the weights (partitioned in stage 3)

    def __init__(self, model: nn.Module, cfg: Config, env: DistEnv, rebuild):
        if cfg.train.precision == "fp16" and env.device.type != "cuda":
            raise ConfigError(
                "train.precision=fp16 with DeepSpeed needs a CUDA device; use bf16 or fp32 on CPU"
            )
        _join_single_process_group(env)
        import deepspeed  # here, so a DDP run never pays for (or depends on) importing it

        from aiayn.distributed import deepspeed_config, op_builds

        deepspeed.utils.logger.setLevel(logging.WARNING)
        op_builds.wait_for_op_builds()  # deepspeed.initialize compiles ops on first use
        self.ds_config = deepspeed_config.build(cfg, env.world_size, env.device.type)
        _checkpoint_layers(model, cfg)
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=[p for _, p in reshard.trainable(model)],
            config=self.ds_config,
            lr_scheduler=lambda optimizer: _paper_schedule(optimizer, cfg),
            dist_init_required=False,
        )
        self.module = self.model.module
        self.device = env.device
        self.precision = cfg.train.precision
        self.world_size = env.world_size
        self.zero_stage = cfg.distributed.zero_stage
        self.offload = cfg.distributed.offload_optimizer or cfg.distributed.offload_params
        self.rebuild = rebuild  # a plain model of the same architecture, for ZeRO-3 gathers
        self._gathered = deepspeed.zero.GatheredParameters
        self._grad_norm: torch.Tensor | None = None
        if deepspeed_config.plain_optimizer(cfg):
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TrainingError(
                    f"DeepSpeed wrapped the stage-0 optimizer in {type(self.optimizer).__name__}; "
                    "aiayn expected a torch optimizer to clip for (distributed/deepspeed_config.py)"
                )

            # DeepSpeed computes no norm here (and was told not to clip): clip as LocalEngine
            # does, when its step has all-reduced the gradients and calls the optimizer.
            def clip(optimizer, args, kwargs) -> None:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                self._grad_norm = clip_gradients(params, cfg.train.clip_norm)

            self.optimizer.register_step_pre_hook(clip)

    @property
    def lr(self) -> float:
        return self.model.get_lr()[0]

    @property
    def loss_scale(self) -> float:
        return (
            float(self.model._get_optimizer_loss_scale() or 1.0)
            if "fp16" in self.ds_config
            else 1.0
        )

    @property
    def skipped_steps(self) -> int:
        return self.model.skipped_steps

    # DeepSpeed's forward applies torch_autocast itself; validation calls the bare module.
    autocast = LocalEngine.autocast

    def backward(self, loss: torch.Tensor) -> None:
        # As for DDP: the loop already divided by the step's tokens on all ranks, and
        # DeepSpeed averages over ranks; its own division by the accumulation steps is off.
        self.model.backward(loss * self.world_size, scale_wrt_gas=False)

    def accumulating(self, last: bool):
        return contextlib.nullcontext()  # managed_gradient_accumulation=false: step() reduces

    def replicas_differ(self, env: DistEnv) -> bool:
        if self.zero_stage == 3:
            return False  # each rank holds its own partition: nothing is replicated
        return LocalEngine.replicas_differ(self, env)

    def step(self) -> torch.Tensor:
        self.model.step()
        if self._grad_norm is not None:
            norm, self._grad_norm = self._grad_norm, None
            return norm.detach()
        norm = self.model.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else norm).detach()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @contextlib.contextmanager
    def full_module(self):
        if self.zero_stage < 3:
            yield self.module  # stages 0-2 keep whole parameters on every rank
            return
        # Gathered one tensor at a time into a plain copy, so the peak is one extra model, and
        # the copy's forward needs no collectives (rank 0 decodes alone during validation).
        with torch.random.fork_rng(devices=[]):  # building it must not move the dropout RNG
            plain = self.rebuild().to(self.device)
        with torch.no_grad():
            for p, q in zip(self.module.parameters(), plain.parameters(), strict=True):
                with self._gathered([p]):
                    q.copy_(p.data)
        plain.train(self.module.training)
        yield plain

    def save_shards(self, directory: Path) -> None:
        # Every rank writes its ZeRO partition; this is a collective.
        self.model.save_checkpoint(str(directory), tag=DEEPSPEED_DIR, save_latest=False)

    def state_dict(self) -> dict[str, Any]:
        return {}  # optimizer, schedule and loss scale are in the DeepSpeed shards

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        if not (checkpoint / DEEPSPEED_DIR).is_dir():
            raise CheckpointError(
                f"{checkpoint} was not written by a DeepSpeed run (no {DEEPSPEED_DIR}/ shards): "
                "resume it with the backend it was trained with, or start a new run_dir"
            )
        # The manifest's checksums of these files were verified before we got here.
        path, _ = self.model.load_checkpoint(
            str(checkpoint),
            tag=DEEPSPEED_DIR,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the shards in {checkpoint}")

    def load_portable(self, state: Portable) -> None:
        """Restore from a checkpoint written on another topology (distributed/reshard.py):
        every rank holds the whole state and keeps its own partition of it."""
        if self.offload or "fp16" in self.ds_config:
            raise CheckpointError(
                "resuming on another topology is not supported with DeepSpeed's CPU offload or "
                "fp16 optimizer (their optimizers keep state in other forms): resume without "
                "distributed.offload_* and with train.precision fp32 or bf16, then change them "
                "at a later resume on the same topology"
            )
        params = reshard.trainable(self.module)
        self._load_weights(params, state.weights)
        zero = self.model.optimizer
        if self.zero_stage == 0:  # DeepSpeed runs the torch optimizer on the module itself
            _load_torch_adam(zero, params, state)
        else:
            from deepspeed.utils import lazy_init_hp_params_optimizer_state
            from deepspeed.utils import safe_set_full_optimizer_state as set_state

            # Adam creates its state at the first step; create it here, on this rank's flat
            # fp32 partitions, then write each parameter's share through DeepSpeed's
            # tensor-fragment API, which knows every stage's partitioning.
            flats = (
                zero.fp32_partitioned_groups_flat
                if self.zero_stage == 3
                else zero.single_partition_of_fp32_groups
            )
            for flat in flats:
                zero.optimizer.state[flat] = {
                    "step": torch.tensor(float(state.step)),
                    **{k: torch.zeros_like(flat) for k in reshard.MOMENTS},
                }
            if self.zero_stage < 3:  # link each parameter to its slice of the new state
                for group, flat in zip(zero.bit16_groups, flats, strict=True):
                    lazy_init_hp_params_optimizer_state(group, flat, zero.optimizer.state)
                zero._hp_optimizer_states_linked = True
            for name, p in params:
                for key, value in state.moments.get(name, {}).items():
                    set_state(p, value.to(self.device), key)
        _load_schedule(self.scheduler, state)
        # DeepSpeed's own counters: steps taken (skipped ones included) and samples seen.
        self.model.skipped_steps = state.skipped_steps
        self.model.global_steps = state.scheduler["last_epoch"] + state.skipped_steps
        self.model.global_samples = self.model.global_steps * self.model.train_batch_size()

    def _load_weights(self, params, weights: dict[str, torch.Tensor]) -> None:
        """Module weights, then the optimizer's fp32 master copies from them."""
        with torch.no_grad():
            for name, p in params:
                # ZeRO-3 keeps only a partition: gather, write the whole tensor, re-partition.
                with (
                    self._gathered([p], modifier_rank=0)
                    if self.zero_stage == 3
                    else contextlib.nullcontext()
                ):
                    p.data.copy_(weights[name].to(p.device, p.dtype).view_as(p.data))
        if self.zero_stage > 0:
            self.model.optimizer.refresh_fp32_params()


def _join_single_process_group(env: DistEnv) -> None:
    """DeepSpeed needs a process group even for one process; torchrun's would be there."""
    if dist.is_initialized():
        return
    for name, value in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)):
        os.environ.setdefault(name, str(value))  # DeepSpeed's sanity check reads them
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def build_engine(model: nn.Module, cfg: Config, env: DistEnv, rebuild=None):
    """DeepSpeed when configured; else DDP across processes, or the plain engine on one.

    `rebuild` makes a fresh model of the same architecture (ZeRO-3 gathers weights into it).
    """
    if cfg.distributed.backend == "deepspeed":
        return DeepSpeedEngine(model, cfg, env, rebuild)
    if env.distributed:
        return DDPEngine(model, cfg, env)
    return LocalEngine(model, cfg, env.device)
