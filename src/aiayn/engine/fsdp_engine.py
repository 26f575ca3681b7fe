"""PyTorch's FSDP2 (`fully_shard`) as an `Engine` (engine/interface.py); distributed.backend=fsdp.

Each encoder and decoder layer is one FSDP unit and the root holds the rest (embeddings, the
final norms, the output projection): a rank keeps 1/W of every parameter, gradient and Adam
moment, rows [r * c, (r + 1) * c) of each, c = ceil(rows / W) (torch.chunk's cut), and gathers
a unit's parameters for its forward and backward. Compile and activation checkpointing are
applied to the layers first, from outside the model, as the other engines do (torchtitan's
order). The optimizer, the schedule and clipping are the ones every engine uses, on the
sharded parameters (DTensors).

A checkpoint: each rank writes its shards into one safetensors file of its own
(fsdp/rank_<r>.safetensors: each parameter's rows, fp32, and its Adam moments), and the range
writer's model.safetensors holds the whole weights, gathered one tensor at a time, never the
whole model on a rank. A resume on the same world size reads a rank's own file; on another
topology the files read back by element range (`read`) as a `Portable`, which any engine
loads, and this one loads any engine's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from aiayn.config import Config
from aiayn.distributed.env import DistEnv, join_single_process_group
from aiayn.engine import parallelize
from aiayn.engine.ema import EMA, Piece, file_keys, saved_weights
from aiayn.engine.kind import Kind
from aiayn.engine.optim import load_schedule
from aiayn.engine.precision import autocast
from aiayn.engine.recipe import Recipe
from aiayn.engine.state import MOMENTS, WEIGHT, Portable, Rows, Weights, saved_specs, trainable
from aiayn.errors import CheckpointError
from aiayn.runtime.tensor_files import TensorFile, write_slices

log = logging.getLogger("aiayn")

FOLDER = "fsdp"
STEP_KEY = "aiayn_adam_step"  # a rank file's metadata: Adam's step count


def problems(cfg: Config) -> list[str]:
    """The run config's settings FSDP2 cannot run here."""
    if cfg.train.precision == "fp16":
        return [
            "train.precision=fp16 with distributed.backend=fsdp: FSDP2 needs a gradient scaler "
            "that knows the gradients are sharded, which aiayn does not build; use bf16 (no "
            "loss scaling needed) or another backend"
        ]
    return []


def shard_rank(name: str) -> int | None:
    found = re.fullmatch(rf"{FOLDER}/rank_(\d+)\.safetensors", name)
    return int(found.group(1)) if found else None


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / FOLDER / f"rank_{rank:05d}.safetensors"


def rows_of(shape: torch.Size, rank: int, world: int) -> tuple[int, int]:
    """The rows [a, b) of a parameter of `shape` that `rank` keeps (torch.chunk's cut)."""
    rows = shape[0] if len(shape) else 1
    chunk = math.ceil(rows / world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def elements_of(shape: torch.Size, rank: int, world: int) -> tuple[int, int]:
    """The same rows as elements of the flattened parameter."""
    a, b = rows_of(shape, rank, world)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return a * row, b * row


class FSDPEngine:
    """FSDP2 behind the `Engine` interface."""

    loads_weights = False  # the rank files hold the weights, each rank its rows
    partitioned = True  # a forward gathers each unit's parameters: every rank takes part

    def __init__(self, model: nn.Module, cfg: Config, env: DistEnv, recipe: Recipe, rebuild):
        # Imported here, not with the module, which the registry imports for every run: with
        # torch.distributed.fsdp imported, about one two-rank DDP validation in six hung in
        # destroy_process_group at its end (tests/distributed/validate_dev.py).
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        join_single_process_group(env)  # fully_shard needs a group even for one process
        self.device, self.precision = env.device, recipe.precision
        self.rank, self.world_size = env.rank, env.world_size
        self.clip_norm = recipe.clip_norm
        self.rebuild = rebuild
        model.to(self.device)
        # gloo has no bf16 reduction (pytorch#111131), and fp32 sums are what DDP makes.
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if self.precision == "bf16" else None,
            reduce_dtype=torch.float32,
        )
        # Pinned host memory needs an accelerator; on a CPU run offload changes nothing.
        pin = self.device.type == "cuda"
        offload = CPUOffloadPolicy(pin) if cfg.distributed.fsdp.offload else OffloadPolicy()
        reshard = cfg.distributed.fsdp.reshard_after_forward
        for layer in parallelize.layers(model):
            fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        # Decoding calls the model's methods, not forward: they gather the root's weights too.
        for method in ("encode", "decode"):
            if hasattr(model, method):
                register_fsdp_forward_method(model, method)
        self.module = self.model = model
        self.optimizer = recipe.optimizer([p for _, p in trainable(model)])  # the DTensors
        self.scheduler = recipe.schedule(self.optimizer)
        self.skipped_steps = 0
        self.loss_scale = 1.0
        self.ema = None if recipe.ema_decay is None else self._ema(recipe)
        if env.is_main:
            log.info(
                "FSDP2: each layer's weights %s after its forward, computed in %s, gradients "
                "reduced in fp32%s%s",
                "freed" if reshard else "kept until its backward",
                "bf16" if self.precision == "bf16" else "fp32",
                " (gloo has no bf16 reduction)" if self.device.type == "cpu" else "",
                ", all of it offloaded to host memory" if cfg.distributed.fsdp.offload else "",
            )

    def _ema(self, recipe: Recipe) -> EMA:
        """train.ema of this rank's rows of each parameter: no rank holds the whole EMA."""
        named = trainable(self.module)
        keys = file_keys(self.module)
        pieces = []
        for _, p in named:
            a, b = elements_of(p.shape, self.rank, self.world_size)
            pieces.append(Piece(keys[id(p)], p.shape, a, b, b - a))

        def gather(i: int, mine: torch.Tensor) -> torch.Tensor:
            shape = named[i][1].shape
            a, b = elements_of(shape, 0, self.world_size)
            padded = torch.zeros(b - a, dtype=mine.dtype, device=mine.device)
            padded[: mine.numel()] = mine
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded)
            cuts = [elements_of(shape, r, self.world_size) for r in range(self.world_size)]
            return torch.cat([t[: e - s] for t, (s, e) in zip(parts, cuts, strict=True)])

        return recipe.ema(pieces, lambda: [p.to_local() for _, p in named], gather)

    def _sharded(self) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters as their shards (DTensors). With reshard_after_forward
        false, a forward without a backward (validation's) leaves them gathered."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return trainable(self.module)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def autocast(self):
        return autocast(self.device, self.precision)

    def backward(self, loss: torch.Tensor) -> None:
        # The loop divides by the tokens of all ranks; the reduce-scatter averages over ranks.
        (loss * self.world_size).backward()

    def accumulating(self, last: bool):
        # Gradients are reduced once per optimizer step, on its last micro-batch.
        self.module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def replicas_differ(self, env: DistEnv) -> bool:
        return False  # each rank holds its own rows: nothing is replicated

    def step(self) -> torch.Tensor:
        if self.ema is not None:
            self.ema.begin()
        params = [p for _, p in trainable(self.module)]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        # A DTensor of each rank's rows' norm: the whole norm is a collective.
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if self.clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_norm, norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        return norm.detach()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @contextlib.contextmanager
    def full_module(self):
        # Gathered one tensor at a time into a plain copy, as ZeRO-3's is.
        with torch.random.fork_rng(devices=[]):
            plain = self.rebuild().to(self.device)
        self._sharded()
        own = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, q in plain.named_parameters():
                q.copy_(own[name].full_tensor())
        plain.train(self.module.training)
        yield plain

    @contextlib.contextmanager
    def weights(self):
        # Each parameter gathered as the save reaches it (every rank in the same order).
        specs, metadata = saved_specs(self.rebuild)
        self._sharded()
        params = dict(self.module.named_parameters(remove_duplicate=False))
        buffers = dict(self.module.named_buffers(remove_duplicate=False))

        def each(names: list[str]):
            for name in names:
                dtype = specs[name].dtype
                if name in params:
                    yield name, params[name].full_tensor().to(dtype)
                else:
                    yield name, buffers[name].to(dtype)

        yield Weights(specs, metadata, each, transient=True)

    def ema_weights(self):
        return saved_weights(self)

    def ema_applied(self):
        return self.ema.applied([p.to_local() for _, p in self._sharded()])

    def save_shards(self, directory: Path) -> list[Path]:
        """This rank's rows of every trainable parameter and of its Adam moments."""
        tensors, steps = {}, []
        for name, p in self._sharded():
            tensors[name] = p.to_local().detach()
            state = self.optimizer.state.get(p, {})
            for key in MOMENTS:
                if key in state:
                    tensors[f"{name}/{key}"] = state[key].to_local().detach()
            steps += [state["step"]] if "step" in state else []
        step = int(steps[-1]) if steps else 0  # one count for all (one host sync, not one each)
        path = _rank_file(directory, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written from the tensors themselves, a part at a time: no copy of the rank's share.
        layout = TensorFile.of(tensors, {STEP_KEY: str(step)})
        items = ((name, tensors[name]) for name in layout.names)
        write_slices(path, layout.slices(items, 0, layout.size, lambda t: t), 0, layout.size)
        return [path]

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "skipped_steps": 0}

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        """This rank's own file: the rows it wrote, bit for bit."""
        path = _rank_file(checkpoint, self.rank)
        if not path.is_file():
            raise CheckpointError(
                f"{checkpoint} has no {path.relative_to(checkpoint)}: it was not written by an "
                "FSDP2 run of this world size; resume it with the backend it was trained with"
            )
        with safe_open(str(path), framework="pt") as fh:
            names = set(fh.keys())

            def rows(name: str, key: str) -> torch.Tensor:
                return fh.get_tensor(name if key == WEIGHT else f"{name}/{key}")

            step = int((fh.metadata() or {}).get(STEP_KEY, 0))
            self._load(rows, lambda name: f"{name}/{MOMENTS[0]}" in names, step)
        load_schedule(self.scheduler, state["scheduler"])

    def load_portable(self, state: Portable) -> None:
        """Restore from a checkpoint of another topology: each rank reads its rows."""

        def mine(name: str, key: str) -> torch.Tensor:
            shape = state.shapes[name]
            a, b = elements_of(shape, self.rank, self.world_size)
            return state.read(name, key, a, b)

        self._load(mine, state.has_moments, state.step)
        load_schedule(self.scheduler, state.scheduler)
        self.skipped_steps = state.skipped_steps

    def _load(self, rows, stepped, step: int) -> None:
        """Each parameter's local rows (`rows(name, key)`, any shape of the right size) into
        the module and Adam's state, which torch makes at the first step: made here."""
        with torch.no_grad():
            for name, p in self._sharded():
                local = p.to_local()
                local.copy_(rows(name, WEIGHT).view(local.shape))
                if not stepped(name):
                    continue  # Adam never stepped it: it starts from zeros
                adam = {"step": torch.tensor(float(step))}
                for key in MOMENTS:
                    moment = torch.zeros_like(p)
                    moment.to_local().copy_(rows(name, key).view(local.shape))
                    adam[key] = moment
                self.optimizer.state[p] = adam


class _Files:
    """The rank files of a checkpoint, each opened when a read first needs its rows: a rank
    of a new topology opens the few whose rows overlap its own, not all W of them."""

    def __init__(self, paths: list[Path], opened: contextlib.ExitStack):
        self.paths, self.opened, self.handles = paths, opened, {}

    def __getitem__(self, rank: int):
        if rank not in self.handles:
            path = str(self.paths[rank])
            self.handles[rank] = self.opened.enter_context(safe_open(path, framework="pt"))
        return self.handles[rank]


class _Joined:
    """A parameter's flattened tensor, read by element range from the rows of the ranks that
    hold them (`elements_of` on the world size that wrote the files)."""

    itemsize = 4  # the rank files hold fp32 rows

    def __init__(self, files: _Files, key: str, shape: torch.Size):
        self.files, self.key, self.shape = files, key, shape
        self.numel = math.prod(shape)

    def read(self, start: int, end: int) -> torch.Tensor:
        world, out = len(self.files.paths), []
        if start >= end:
            return torch.zeros(0)
        # Every rank but the last holds the same count of elements, rank 0's: the ranks that
        # hold [start, end) follow by division, not by a walk over all `world` of them.
        each = max(elements_of(self.shape, 0, world)[1], 1)
        for rank in range(start // each, min((end - 1) // each + 1, world)):
            a, b = elements_of(self.shape, rank, world)
            lo, hi = max(start, a), min(end, b)
            if lo < hi:
                out.append(Rows(self.files[rank], self.key).read(lo - a, hi - a))
        return torch.cat(out) if out else torch.zeros(0)


@contextlib.contextmanager
def read(ckpt: Path, trainer_state: dict[str, Any], shapes: dict) -> Iterator[Portable]:
    """An FSDP2 checkpoint's rank files as a Portable (engine/kind.py's `portable`)."""
    folder = ckpt / FOLDER
    paths = sorted(folder.glob("rank_*.safetensors")) if folder.is_dir() else []
    if not paths or [shard_rank(f"{FOLDER}/{p.name}") for p in paths] != list(range(len(paths))):
        raise CheckpointError(f"{folder}: the rank files are missing or incomplete")
    engine = trainer_state["engine"]
    with contextlib.ExitStack() as opened:
        files = _Files(paths, opened)
        keys = set(files[0].keys())  # every rank's file holds every parameter's rows
        missing = [name for name in shapes if name not in keys]
        if missing:
            raise CheckpointError(
                f"{folder} does not hold this model's parameters (missing: {missing[:3]}): it "
                "was written by another model; use its config, or a new run_dir"
            )
        tensors = {}
        for name, shape in shapes.items():
            for key in (WEIGHT, *MOMENTS):
                stored = name if key == WEIGHT else f"{name}/{key}"
                if stored in keys:
                    tensors[name, key] = _Joined(files, stored, torch.Size(shape))
        step = int((files[0].metadata() or {}).get(STEP_KEY, 0))
        yield Portable(dict(shapes), tensors, step, engine["scheduler"], engine["skipped_steps"])


KIND = Kind(
    name="fsdp",
    title="FSDP2",
    build="aiayn.engine.fsdp_engine:FSDPEngine",
    options=("fsdp",),
    check=problems,
    shard_rank=shard_rank,
    portable=read,
)
