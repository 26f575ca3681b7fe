"""The topology-independent optimizer state (distributed/reshard.py) without a second process: the
torch optimizer's state round-trips through it exactly, and ZeRO partitions cut the way
DeepSpeed cuts them merge back into whole tensors. Real DeepSpeed shards: tests/distributed."""

import math
from types import SimpleNamespace

import pytest
import torch

from aiayn.config import load_config
from aiayn.distributed import reshard
from aiayn.distributed.ddp_engine import LocalEngine
from aiayn.distributed.deepspeed_engine import DeepSpeedEngine
from aiayn.errors import CheckpointError
from aiayn.model import build_model

from batches import TINY

SHAPES = {"a": torch.Size([3, 5]), "b": torch.Size([7]), "c": torch.Size([2, 2])}


def engine_after_steps(steps: int) -> LocalEngine:
    cfg = load_config(None, TINY)
    torch.manual_seed(0)
    engine = LocalEngine(build_model(cfg.model, 50, 0), cfg, torch.device("cpu"))
    for _ in range(steps):
        for p in engine.module.parameters():
            p.grad = torch.randn_like(p)
        engine.step()
    return engine


def test_torch_adam_state_round_trips_exactly_through_the_portable_form():
    source = engine_after_steps(3)
    names = [n for n, _ in reshard.trainable(source.module)]
    weights = {n: p.detach().clone() for n, p in reshard.trainable(source.module)}
    saved = source.state_dict()
    state = reshard._from_torch_optimizer(saved["optimizer"], weights, names,
                                          saved["scheduler"], 0)  # fmt: skip
    assert state.step == 3 and set(state.moments) == set(names)
    target = engine_after_steps(0)  # another initialisation, no Adam state yet
    target.load_portable(state)
    assert target.lr == source.lr  # the schedule's position and the lr it set
    torch.manual_seed(1)
    grads = [torch.randn_like(p) for p in source.module.parameters()]
    for engine in (source, target):
        for p, g in zip(engine.module.parameters(), grads, strict=True):
            p.grad = g.clone()
        engine.step()
    for (n, p), (_, q) in zip(
        reshard.trainable(source.module), reshard.trainable(target.module), strict=True
    ):
        assert torch.equal(p, q), n


def zero3_partitions(full: dict[str, torch.Tensor], world: int) -> list[torch.Tensor]:
    """As ZeRO-3 cuts: each parameter into `world` pieces of ceil(numel / world), zero-padded."""
    ranks = [[] for _ in range(world)]
    for t in full.values():
        piece = math.ceil(t.numel() / world)
        padded = torch.cat([t.flatten(), torch.zeros(piece * world - t.numel())])
        for r in range(world):
            ranks[r].append(padded[r * piece : (r + 1) * piece])
    return [torch.cat(parts) for parts in ranks]


def zero12_partitions(full: dict[str, torch.Tensor], paddings: list[int], world: int):
    """As ZeRO-1/2 cut: one flat group (each tensor followed by its alignment padding),
    padded at the end to a multiple of `world`, cut into `world` equal pieces."""
    parts = [
        torch.cat([t.flatten(), torch.zeros(pad)])
        for t, pad in zip(full.values(), paddings, strict=True)
    ]
    flat = torch.cat(parts)
    flat = torch.cat([flat, torch.zeros(-flat.numel() % world)])
    return list(flat.chunk(world))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero_partitions_merge_back_into_whole_tensors(world):
    full = {n: torch.randn(s) for n, s in SHAPES.items()}
    merged = reshard._zero3_merge(zero3_partitions(full, world), SHAPES, world)
    assert all(torch.equal(merged[n], full[n]) for n in full)
    paddings = [1, 0, 3]
    flat = torch.cat(zero12_partitions(full, paddings, world))
    merged = reshard._zero12_merge([flat], [SHAPES], [paddings])
    assert all(torch.equal(merged[n], full[n]) for n in full)


def test_partitions_of_another_model_are_refused():
    full = {n: torch.randn(s) for n, s in SHAPES.items()}
    other = {**SHAPES, "b": torch.Size([9])}
    with pytest.raises(CheckpointError, match="do not belong to this model"):
        reshard._zero3_merge(zero3_partitions(full, 2), other, 2)
    with pytest.raises(CheckpointError, match="do not belong to this model"):
        reshard._zero12_merge([torch.cat(zero12_partitions(full, [0, 0, 0], 1))], [other], None)


def test_which_topologies_share_a_layout():
    ddp1, ddp4 = reshard.Topology("ddp", 0, 1), reshard.Topology("ddp", 0, 4)
    z2, z3 = reshard.Topology("deepspeed", 2, 2), reshard.Topology("deepspeed", 3, 2)
    assert ddp1.same_layout(ddp4)  # a torch optimizer's state is whole on every rank
    assert z3.same_layout(reshard.Topology("deepspeed", 3, 2))
    assert not z3.same_layout(reshard.Topology("deepspeed", 3, 4))
    assert not z2.same_layout(z3) and not z3.same_layout(ddp1) and not ddp1.same_layout(z2)
    assert str(z3) == "DeepSpeed ZeRO-3 on 2 rank(s)" and str(ddp4) == "DDP on 4 rank(s)"


@pytest.mark.parametrize("offload, ds_config", [(True, {}), (False, {"fp16": {}})])
def test_deepspeed_refuses_what_it_cannot_reshard_and_says_what_to_do(offload, ds_config):
    engine = SimpleNamespace(offload=offload, ds_config=ds_config)
    with pytest.raises(CheckpointError, match="resume without distributed.offload_"):
        DeepSpeedEngine.load_portable(engine, None)
