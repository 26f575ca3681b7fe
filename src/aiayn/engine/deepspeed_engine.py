"""DeepSpeed ZeRO stages 0-3, with optional CPU offload, as an `Engine` (engine/interface.py);
distributed.backend=deepspeed."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from aiayn.config import Config
from aiayn.distributed.env import DistEnv, join_single_process_group
from aiayn.engine import deepspeed_config, op_builds
from aiayn.engine.deepspeed_files import DEEPSPEED_DIR
from aiayn.engine.ema import EMA, Piece, file_keys, saved_weights, whole_pieces
from aiayn.engine.optim import clip_gradients, load_schedule, load_torch_adam
from aiayn.engine.precision import autocast
from aiayn.engine.recipe import Recipe
from aiayn.engine.replicas import replicas_differ
from aiayn.engine.state import MOMENTS, WEIGHT, Portable, Weights, saved_specs, trainable
from aiayn.errors import CheckpointError, ConfigError, TrainingError
from aiayn.runtime import io_counts


class DeepSpeedEngine:
    """DeepSpeed ZeRO behind the `Engine` interface.

    The DeepSpeed config comes from `deepspeed_config.build`, so the run config stays the one
    source of truth. DeepSpeed owns clipping, the optimizer and stepping the schedule (we hand
    it the paper's schedule as a callable); the loop keeps owning the accumulation boundary.
    """

    loads_weights = False  # the ZeRO shards hold the weights (partitioned in stage 3)

    def __init__(self, model: nn.Module, cfg: Config, env: DistEnv, recipe: Recipe, rebuild):
        if recipe.precision == "fp16" and env.device.type != "cuda":
            raise ConfigError(
                "train.precision=fp16 with DeepSpeed needs a CUDA device; use bf16 or fp32 on CPU"
            )
        join_single_process_group(env)  # DeepSpeed needs a group even for one process
        deepspeed.utils.logger.setLevel(logging.WARNING)
        op_builds.wait_for_op_builds()  # deepspeed.initialize compiles ops on first use
        op_builds.skip_inference_all_reduce()
        self.ds_config = deepspeed_config.build(cfg, env.world_size, env.device.type)
        # DeepSpeed builds its Adam from ds_config (the recipe's settings) and wraps it.
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=[p for _, p in trainable(model)],
            config=self.ds_config,
            lr_scheduler=recipe.schedule,
            dist_init_required=False,
        )
        self.module = self.model.module
        self.device = env.device
        self.precision = recipe.precision
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
                    "aiayn expected a torch optimizer to clip for (engine/deepspeed_config.py)"
                )

            # DeepSpeed computes no norm here (and was told not to clip): clip as LocalEngine
            # does, when its step has all-reduced the gradients and calls the optimizer.
            def clip(optimizer, args, kwargs) -> None:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                self._grad_norm = clip_gradients(params, recipe.clip_norm)

            self.optimizer.register_step_pre_hook(clip)
        self.ema = None if recipe.ema_decay is None else self._ema(recipe)

    def _ema(self, recipe: Recipe) -> EMA:
        """train.ema: stages 0-2 hold the whole weights on every rank, and each rank their
        whole EMA; under stage 3 each rank keeps the EMA of its own partition of each
        parameter (elements [r * n, (r + 1) * n) of the flattened tensor, zero-padded as
        DeepSpeed pads it), so no rank ever holds the whole EMA."""
        named = trainable(self.module)
        if self.zero_stage < 3:
            params = [p for _, p in named]
            return recipe.ema(whole_pieces(self.module, named), lambda: params)
        keys = file_keys(self.module)
        pieces = []
        for _, p in named:
            n = p.ds_tensor.ds_numel
            start = p._z3_optimizer._get_param_partition_rank(p) * n
            pieces.append(Piece(keys[id(p)], p.ds_shape, start, min(start + n, p.ds_numel), n))

        def gather(i: int, mine: torch.Tensor) -> torch.Tensor:
            # One parameter at a time, as a save of the model gathers it.
            mine = mine.to(self.device)
            parts = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(parts, mine)
            return torch.cat(parts)

        return recipe.ema(pieces, lambda: [p.ds_tensor for _, p in named], gather)

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

    def autocast(self):
        # DeepSpeed's forward applies torch_autocast itself; validation calls the bare module.
        return autocast(self.device, self.precision)

    def backward(self, loss: torch.Tensor) -> None:
        # As for DDP: the loop already divided by the step's tokens on all ranks, and
        # DeepSpeed averages over ranks; its own division by the accumulation steps is off.
        self.model.backward(loss * self.world_size, scale_wrt_gas=False)

    def accumulating(self, last: bool):
        return contextlib.nullcontext()  # managed_gradient_accumulation=false: step() reduces

    def replicas_differ(self, env: DistEnv) -> bool:
        if self.zero_stage == 3:
            return False  # each rank holds its own partition: nothing is replicated
        return replicas_differ(self.module, env)

    def step(self) -> torch.Tensor:
        if self.ema is not None:
            self.ema.begin()  # before the first update: the average includes the start
        skipped = self.skipped_steps
        self.model.step()
        if self.ema is not None and self.skipped_steps == skipped:  # fp16 overflow: no update
            self.ema.update()
        if self._grad_norm is not None:
            norm, self._grad_norm = self._grad_norm, None
            return norm.detach()
        norm = self.model.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else norm).detach()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @property
    def partitioned(self) -> bool:
        return self.zero_stage == 3

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

    @contextlib.contextmanager
    def weights(self):
        if self.zero_stage < 3:
            yield Weights.of(self.module)
            return
        # The values gathered one parameter at a time as a save asks for them, cast to the
        # plain model's dtype as full_module's copy is: the same model.safetensors, without
        # the whole model on any rank.
        specs, metadata = saved_specs(self.rebuild)
        params = dict(self.module.named_parameters(remove_duplicate=False))
        buffers = dict(self.module.named_buffers(remove_duplicate=False))

        def each(names: list[str]):
            for name in names:
                dtype = specs[name].dtype
                if name not in params:
                    yield name, buffers[name].to(dtype)
                    continue
                with self._gathered([params[name]]):
                    yield name, params[name].data.to(dtype)

        yield Weights(specs, metadata, each, transient=True)

    def ema_weights(self):
        return saved_weights(self)

    @contextlib.contextmanager
    def ema_applied(self):
        named = trainable(self.module)
        if self.zero_stage < 3:
            with self.ema.applied([p.data for _, p in named]):
                yield
            return
        # ZeRO-3 gathers a parameter from the partitions for each forward, except its small
        # ones (below stage3_param_persistence_threshold), which stay whole between steps:
        # those get the EMA's whole value too, gathered one at a time (a collective; every
        # rank has the same persistent parameters).
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        whole = [
            (i, p) for i, (_, p) in enumerate(named) if p.ds_status == ZeroParamStatus.AVAILABLE
        ]
        with self.ema.applied([p.ds_tensor for _, p in named]):
            kept = [p.data.clone() for _, p in whole]
            for i, p in whole:
                p.data.copy_(self.ema.whole(i).to(p.device, p.dtype))
            try:
                yield
            finally:
                for (_, p), value in zip(whole, kept, strict=True):
                    p.data.copy_(value)

    def save_shards(self, directory: Path) -> list[Path]:
        # Every rank writes its ZeRO partition; this is a collective.
        try:
            self.model.save_checkpoint(str(directory), tag=DEEPSPEED_DIR, save_latest=False)
            return self._written_by_me(directory)
        except Exception:
            # DeepSpeed writes its files between its other collectives and a closing barrier,
            # which a rank whose write failed (a full disk) skips: join that barrier here, so
            # that the other ranks leave it and every rank reaches the manager's next
            # collective, which tells them all that the save failed.
            if dist.is_initialized():
                dist.barrier()
            raise

    def _written_by_me(self, directory: Path) -> list[Path]:
        """This rank's DeepSpeed files, named as DeepSpeed names them: its model states
        (rank 0's under ZeRO 0-2, every rank's under ZeRO-3) and its ZeRO partition of the
        optimizer. Named, not found by listing the folder, which holds two files per rank:
        W listings of W files each, at W = 1,024 a million entries read. A file DeepSpeed
        adds that is not named here (its zero_to_fp32.py) the writer hashes as rank 0's."""
        ds, where = self.model, str(directory)
        names = []
        if ds.save_non_zero_checkpoint:
            names.append(ds._get_ckpt_name(where, DEEPSPEED_DIR))
        if ds.save_zero_checkpoint:
            names.append(ds._get_zero_ckpt_name(where, DEEPSPEED_DIR))
        io_counts.count("stats", len(names))
        return [Path(name) for name in names if os.path.isfile(name)]

    def _read_own_files_only(self) -> None:
        """At a load, DeepSpeed lists the checkpoint folder for the model states
        (`_get_all_ckpt_names`, a glob) and stats every rank's optimizer partition
        (`_get_all_zero_checkpoint_names`), though it reads only this rank's: O(W) metadata
        calls on each of W ranks. Name this rank's files instead. Only where DeepSpeed reads
        this rank's alone: not with an elastic or universal checkpoint (which we never
        configure; then DeepSpeed's own lookup stands)."""
        ds = self.model
        if ds.zero_elastic_checkpoint() or ds.load_universal_checkpoint():
            return

        def model_states(path, tag):
            return [ds._get_ckpt_name(path, tag)]

        def zero_partitions(path, tag, bf16_mode):
            own = dist.get_rank(group=ds.optimizer.dp_process_group)
            names = [None] * ds.loaded_checkpoint_dp_world_size  # theirs: not read
            names[own] = ds._get_rank_zero_ckpt_name(
                path, tag, ds.checkpoint_mp_rank, own, bf16_mode
            )
            return names

        # Instance attributes: they shadow the engine's methods for this engine only.
        ds._get_all_ckpt_names = model_states
        ds._get_all_zero_checkpoint_names = zero_partitions

    def state_dict(self) -> dict[str, Any]:
        return {}  # optimizer, schedule and loss scale are in the DeepSpeed shards

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        if not io_counts.exists(checkpoint / DEEPSPEED_DIR):
            raise CheckpointError(
                f"{checkpoint} was not written by a DeepSpeed run (no {DEEPSPEED_DIR}/ shards): "
                "resume it with the backend it was trained with, or start a new run_dir"
            )
        # The manifest's checksums of these files were verified before we got here.
        self._read_own_files_only()
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
        """Restore from a checkpoint written on another topology (checkpoint/reshard.py).
        Each rank reads only the part of the state it keeps: its ZeRO partition of the fp32
        weights and of Adam's moments (and under ZeRO 0-2, the whole weights every rank
        holds)."""
        if self.offload or "fp16" in self.ds_config:
            raise CheckpointError(
                "resuming on another topology is not supported with DeepSpeed's CPU offload or "
                "fp16 optimizer (their optimizers keep state in other forms): resume without "
                "distributed.offload_* and with train.precision fp32 or bf16, then change them "
                "at a later resume on the same topology"
            )
        params = trainable(self.module)
        zero = self.model.optimizer
        if self.zero_stage == 0:  # DeepSpeed runs the torch optimizer on the module itself
            self._load_whole_weights(params, state)
            load_torch_adam(zero, params, state)
        else:
            # Adam creates its state at the first step; create it here, on this rank's flat
            # fp32 partitions, then write each parameter's part of it.
            flats = (
                zero.fp32_partitioned_groups_flat
                if self.zero_stage == 3
                else zero.single_partition_of_fp32_groups
            )
            adam = zero.optimizer.defaults
            on_device = adam.get("fused") or adam.get("capturable")
            for flat in flats:
                zero.optimizer.state[flat] = {
                    # torch's Adam: a float tensor, on the parameter's device when fused
                    "step": torch.tensor(
                        float(state.step), device=flat.device if on_device else None
                    ),
                    **{k: torch.zeros_like(flat) for k in MOMENTS},
                }
            if self.zero_stage == 3:
                self._load_zero3_partitions(params, state)
            else:
                self._load_whole_weights(params, state)
                self._load_zero12_moments(params, flats, state)
        load_schedule(self.scheduler, state.scheduler)
        # DeepSpeed's own counters: steps taken (skipped ones included) and samples seen.
        self.model.skipped_steps = state.skipped_steps
        self.model.global_steps = state.scheduler["last_epoch"] + state.skipped_steps
        self.model.global_samples = self.model.global_steps * self.model.train_batch_size()

    def _load_whole_weights(self, params, state: Portable) -> None:
        """Stages 0-2 hold the whole weights on every rank; then the optimizer's fp32 master
        partition from them."""
        with torch.no_grad():
            for name, p in params:
                p.data.copy_(state.whole(name, WEIGHT).to(p.device, p.dtype))
        if self.zero_stage > 0:
            self.model.optimizer.refresh_fp32_params()

    def _load_zero12_moments(self, params, flats, state: Portable) -> None:
        """Each parameter's fragment of this rank's partition (DeepSpeed's tensor-fragment
        mapping says which elements of the flattened parameter it holds)."""
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        zero = self.model.optimizer
        for group, flat in zip(zero.bit16_groups, flats, strict=True):
            lazy_init_hp_params_optimizer_state(group, flat, zero.optimizer.state)
        zero._hp_optimizer_states_linked = True
        for name, p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None or not state.has_moments(name):
                continue  # none of it on this rank, or Adam never stepped it
            start = mapping.lp_fragment_address.start
            end = start + mapping.lp_fragment_address.numel
            for key in MOMENTS:
                fragment = mapping.get_hp_fragment(key)
                fragment.copy_(state.read(name, key, start, end).to(fragment.device))

    def _load_zero3_partitions(self, params, state: Portable) -> None:
        """This rank's piece of each parameter: the elements [r * n, (r + 1) * n) of the
        flattened tensor, n = ceil(numel / W), zero-padded past its end. The weights go into
        the module's partition (then the fp32 master copies from it), the moments into the
        optimizer's."""
        from deepspeed.utils import safe_set_local_optimizer_state

        with torch.no_grad():
            for name, p in params:
                n = p.ds_tensor.ds_numel
                start = p._z3_optimizer._get_param_partition_rank(p) * n
                end = min(start + n, p.ds_numel)

                def piece(key: str, start=start, end=end, n=n, name=name) -> torch.Tensor:
                    out = torch.zeros(n)
                    if start < end:
                        out[: end - start] = state.read(name, key, start, end)
                    return out

                t = p.ds_tensor
                t.data.copy_(piece(WEIGHT).to(t.device, t.dtype))
                if state.has_moments(name):
                    for key in MOMENTS:
                        safe_set_local_optimizer_state(p, piece(key).to(self.device), key)
        self.model.optimizer.refresh_fp32_params()
