"""The topology-independent optimizer state (checkpoint/reshard.py) without a second process: the
torch optimizer's state round-trips through it exactly, and ZeRO partitions cut the way
DeepSpeed cuts them merge back into whole tensors. Real DeepSpeed shards: tests/distributed."""

import math
from types import SimpleNamespace

import pytest
import torch

from aiayn.config import load_config
from aiayn.distributed.env import DistEnv
from aiayn.engine import deepspeed_files, registry
from aiayn.engine import state as engine_state
from aiayn.engine.ddp_engine import LocalEngine
from aiayn.engine.deepspeed_engine import DeepSpeedEngine
from aiayn.engine.registry import build_engine
from aiayn.engine.state import MOMENTS
from aiayn.errors import CheckpointError
from aiayn.model import build_model

from batches import TINY

SHAPES = {"a": torch.Size([3, 5]), "b": torch.Size([7]), "c": torch.Size([2, 2])}


def engine_after_steps(steps: int) -> LocalEngine:
    cfg = load_config(None, TINY)
    torch.manual_seed(0)
    engine = build_engine(build_model(cfg.model, 50, 0), cfg, DistEnv(0, 1, torch.device("cpu")))
    for _ in range(steps):
        for p in engine.module.parameters():
            p.grad = torch.randn_like(p)
        engine.step()
    return engine


def portable_of(engine: LocalEngine) -> engine_state.Portable:
    """The engine's state as a checkpoint would give it to a new topology."""
    shapes = {n: p.shape for n, p in engine_state.trainable(engine.module)}
    weights = {
        (n, engine_state.WEIGHT): engine_state.Pieces([p.detach().clone().flatten()])
        for n, p in engine_state.trainable(engine.module)
    }
    saved = engine.state_dict()
    optimizer, scheduler = saved["optimizer"], saved["scheduler"]
    return engine_state.torch_adam_portable(optimizer, weights, shapes, scheduler, 0)


def test_torch_adam_state_round_trips_exactly_through_the_portable_form():
    source = engine_after_steps(3)
    names = [n for n, _ in engine_state.trainable(source.module)]
    state = portable_of(source)
    assert state.step == 3 and all(state.has_moments(n) for n in names)
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
        engine_state.trainable(source.module), engine_state.trainable(target.module), strict=True
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


def merged(pieces: dict[str, engine_state.Pieces]) -> dict[str, torch.Tensor]:
    return {n: p.read(0, p.numel).view(SHAPES[n]) for n, p in pieces.items()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero_partitions_merge_back_into_whole_tensors(world):
    full = {n: torch.randn(s) for n, s in SHAPES.items()}
    ranks = [engine_state.Pieces([t]) for t in zero3_partitions(full, world)]
    got = merged(deepspeed_files._zero3_pieces(ranks, SHAPES, world))
    assert all(torch.equal(got[n], full[n]) for n in full)
    paddings = [1, 0, 3]
    flat = engine_state.Pieces(zero12_partitions(full, paddings, world))
    got = merged(deepspeed_files._zero12_pieces([flat], [SHAPES], [paddings]))
    assert all(torch.equal(got[n], full[n]) for n in full)


@pytest.mark.parametrize("old", [1, 2, 3, 4])
@pytest.mark.parametrize("new", [1, 2, 3, 4])
def test_each_new_rank_reads_its_partition_and_about_1_over_w_of_the_state(old, new):
    """Resharding W_old ZeRO-3 partitions (sub-groups within each rank, as DeepSpeed keeps them)
    for W_new ranks: each new rank's range of each parameter is exactly that range of the whole
    tensor, and it reads its ranges only: 1/W_new of the elements, however the old files cut
    them."""
    torch.manual_seed(old * 10 + new)
    shapes = {"a": torch.Size([30, 5]), "b": torch.Size([77]), "c": torch.Size([16, 8])}
    full = {n: torch.randn(s) for n, s in shapes.items()}
    subgroups = [[t[: t.numel() // 3], t[t.numel() // 3 :]] for t in zero3_partitions(full, old)]
    pieces = deepspeed_files._zero3_pieces([engine_state.Pieces(g) for g in subgroups], shapes, old)
    total = sum(t.numel() for t in full.values())
    for rank in range(new):
        state = engine_state.Portable(shapes, {(n, "weight"): pieces[n] for n in shapes}, 0, {}, 0)
        for name, shape in shapes.items():
            n = math.ceil(shape.numel() / new)
            start, end = rank * n, min((rank + 1) * n, shape.numel())
            if start < end:
                got = state.read(name, "weight", start, end)
                assert torch.equal(got, full[name].flatten()[start:end])
        share = state.bytes_read / (4 * total)
        assert abs(share - 1 / new) < 0.05, (rank, share)


def test_a_stored_tensor_is_read_by_rows(tmp_path):
    """A tensor of a safetensors file is read by element range through its rows alone."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {"m": torch.randn(9, 7), "v": torch.randn(11)}
    save_file(tensors, tmp_path / "t.safetensors")
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as fh:
        for key, t in tensors.items():
            rows = engine_state.Rows(fh, key)
            for start, end in [(0, t.numel()), (3, 4), (6, 20), (t.numel() - 2, t.numel())]:
                assert torch.equal(rows.read(start, end), t.flatten()[start:end])


@pytest.mark.parametrize("old", [1, 3, 8])
@pytest.mark.parametrize("new", [1, 2, 5])
def test_fsdp_rank_files_read_back_whole_and_a_new_rank_opens_only_its_rows_files(
    tmp_path, monkeypatch, old, new
):
    """FSDP2's rank files (each old rank its rows of weights and moments, torch.chunk's cut)
    read by element range give the whole tensors; a new rank opens the files its rows are in:
    rank 0's (for the names) and those that overlap, not all `old` of them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from aiayn.engine import fsdp_engine

    torch.manual_seed(old * 10 + new)
    shapes = {"a": torch.Size([30, 5]), "b": torch.Size([77]), "c": torch.Size([5, 8])}
    full = {(n, k): torch.randn(s) for n, s in shapes.items() for k in ("weight", *MOMENTS)}
    (tmp_path / "fsdp").mkdir()
    for r in range(old):
        rows = {}
        for (name, key), t in full.items():
            a, b = fsdp_engine.rows_of(t.shape, r, old)
            rows[name if key == "weight" else f"{name}/{key}"] = t[a:b].contiguous()
        path = tmp_path / "fsdp" / f"rank_{r:05d}.safetensors"
        save_file(rows, path, metadata={fsdp_engine.STEP_KEY: "7"})
    opened = []

    def counted(path, **kwargs):
        opened.append(path)
        return safe_open(path, **kwargs)

    monkeypatch.setattr(fsdp_engine, "safe_open", counted)
    trainer = {"engine": {"scheduler": {}, "skipped_steps": 0}}
    for rank in range(new):
        opened.clear()
        with fsdp_engine.read(tmp_path, trainer, shapes) as state:
            assert state.step == 7
            for (name, key), t in full.items():
                a, b = fsdp_engine.elements_of(t.shape, rank, new)
                assert torch.equal(state.read(name, key, a, b), t.flatten()[a:b]), (name, key)
        holding = {
            r
            for shape in shapes.values()
            for r in range(old)
            if max(fsdp_engine.rows_of(shape, r, old)[0], fsdp_engine.rows_of(shape, rank, new)[0])
            < min(fsdp_engine.rows_of(shape, r, old)[1], fsdp_engine.rows_of(shape, rank, new)[1])
        }
        assert len(opened) == len(holding | {0})
        assert len(opened) < old or old < 8 or new == 1
    with fsdp_engine.read(tmp_path, trainer, shapes) as state:  # the whole tensors, for DDP
        assert all(torch.equal(state.whole(n, k), t) for (n, k), t in full.items())


def test_partitions_of_another_model_are_refused():
    full = {n: torch.randn(s) for n, s in SHAPES.items()}
    other = {**SHAPES, "b": torch.Size([9])}
    with pytest.raises(CheckpointError, match="do not belong to this model"):
        ranks = [engine_state.Pieces([t]) for t in zero3_partitions(full, 2)]
        deepspeed_files._zero3_pieces(ranks, other, 2)
    with pytest.raises(CheckpointError, match="do not belong to this model"):
        flat = engine_state.Pieces(zero12_partitions(full, [0, 0, 0], 1))
        deepspeed_files._zero12_pieces([flat], [other], None)


def test_which_topologies_share_a_layout():
    def saved(world: int, backend: str = "ddp", stage: int = 0):
        config = {"distributed": {"backend": backend, "zero_stage": stage}}
        return registry.saved_topology(config, world)

    ddp1, ddp4 = saved(1), saved(4)
    z2, z3 = saved(2, "deepspeed", 2), saved(2, "deepspeed", 3)
    assert ddp1.same_layout(ddp4)  # a torch optimizer's state is whole on every rank
    assert z3.same_layout(saved(2, "deepspeed", 3))
    assert not z3.same_layout(saved(4, "deepspeed", 3))
    assert not z2.same_layout(z3) and not z3.same_layout(ddp1) and not ddp1.same_layout(z2)
    assert str(z3) == "DeepSpeed ZeRO-3 on 2 rank(s)" and str(ddp4) == "DDP on 4 rank(s)"


@pytest.mark.parametrize("offload, ds_config", [(True, {}), (False, {"fp16": {}})])
def test_deepspeed_refuses_what_it_cannot_reshard_and_says_what_to_do(offload, ds_config):
    engine = SimpleNamespace(offload=offload, ds_config=ds_config)
    with pytest.raises(CheckpointError, match="resume without distributed.offload_"):
        DeepSpeedEngine.load_portable(engine, None)
