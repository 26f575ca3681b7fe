"""train.ema, in one process: the average follows its formula (decay 0: the model itself), is
swapped in for validation and out again bit for bit, and a checkpoint's ema.safetensors loads
as a model under the name CKPT/ema (resume, ZeRO-3 and the CLI: tests/e2e/test_kill_resume.py,
tests/distributed/test_zero3_memory.py)."""

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from aiayn.checkpoint import CheckpointManager, read_manifest
from aiayn.checkpoint.init_from import load_weights
from aiayn.checkpoint.locate import locate
from aiayn.config import load_config
from aiayn.distributed.env import DistEnv
from aiayn.engine.ddp_engine import LocalEngine
from aiayn.engine.loss import batch_loss
from aiayn.engine.registry import build_engine
from aiayn.engine.state import Weights
from aiayn.errors import CheckpointError, ConfigError
from aiayn.model import build_model

from batches import TINY, padded_batch


def engine_for(*overrides) -> LocalEngine:
    cfg = load_config(None, [*TINY, "schedule.kind=constant", "schedule.lr=0.01", *overrides])
    torch.manual_seed(0)
    return build_engine(build_model(cfg.model, 50, 0), cfg, DistEnv(0, 1, torch.device("cpu")))


def train_steps(engine: LocalEngine, n: int, seen: list | None = None) -> None:
    for i in range(n):
        with engine.autocast():
            loss, _ = batch_loss(engine.model, padded_batch(seed=i), "seq2seq", 0.1, 0)
        engine.backward(loss)
        engine.step()
        if seen is not None:
            seen.append([p.detach().clone() for p in engine.module.parameters()])


def ema_state(engine: LocalEngine) -> dict[str, torch.Tensor]:
    with engine.ema_weights() as weights:
        return {n: t.clone() for n, t in weights.each(list(weights.specs))}


def test_decay_zero_keeps_the_model_itself():
    engine = engine_for("train.ema=0")
    start = {n: t.clone() for n, t in engine.module.state_dict().items()}
    train_steps(engine, 3)
    now = engine.module.state_dict()
    assert any(not torch.equal(start[n], now[n]) for n in now)  # the weights moved
    ema = ema_state(engine)
    assert set(ema) == set(Weights.of(engine.module).specs)  # model.safetensors' names
    differ = [n for n, t in ema.items() if not torch.equal(t, now[n])]
    assert not differ, differ  # bitwise: 0 * ema + 1 * w is w


@pytest.mark.parametrize("warmup", [True, False])
def test_ema_follows_its_formula_from_the_starting_weights(warmup):
    decay = 0.25  # below the warm-up's decays from update 1 on: (1 + t) / (10 + t) = 0.1, 0.18, ...
    engine = engine_for(f"train.ema={decay}", f"train.ema_warmup={str(warmup).lower()}")
    expected = [p.detach().clone() for p in engine.module.parameters()]  # it starts there
    seen: list = []
    train_steps(engine, 4, seen)
    for t, weights in enumerate(seen):
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        expected = [e * d + w * (1 - d) for e, w in zip(expected, weights, strict=True)]
    got = engine.ema.shadow
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(g, w) for g, w in zip(got, seen[-1], strict=True))
    assert engine.ema.updates == 4 and engine.ema.current_decay() == decay
    assert engine_for().ema is None  # off by default


def test_the_warm_up_reaches_the_decay_and_an_uncounted_checkpoint_keeps_it():
    engine = engine_for("train.ema=0.999")
    decays = []
    for t in (0, 1, 8989, 8991, 20000):
        engine.ema.updates = t
        decays.append(engine.ema.current_decay())
    assert decays[:2] == [0.1, 2 / 11]
    assert decays[2] < 0.999 and decays[3:] == [0.999, 0.999]
    # A checkpoint saved before the count was kept had no warm-up: its decay goes on.
    engine.ema.load(lambda key, start, end: torch.zeros(end - start), {})
    assert engine.ema.updates is None and engine.ema.current_decay() == 0.999
    train_steps(engine, 1)
    assert engine.ema.updates is None


def test_validating_the_ema_swaps_it_in_and_the_weights_back_bitwise():
    engine = engine_for("train.ema=0.9")
    train_steps(engine, 3)
    before = [p.detach().clone() for p in engine.module.parameters()]
    with engine.ema_applied():
        inside = [p.detach().clone() for p in engine.module.parameters()]
    after = list(engine.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.equal(i, s) for i, s in zip(inside, engine.ema.shadow, strict=True))
    assert any(not torch.equal(i, b) for i, b in zip(inside, before, strict=True))


def test_ema_validate_needs_ema():
    with pytest.raises(ConfigError, match="train.ema is off"):
        load_config(None, [*TINY, "train.ema_validate=true"])
    with pytest.raises(ConfigError, match="train.ema"):
        load_config(None, [*TINY, "train.ema=1"])  # never moves: refused


def save(tmp_path, engine, step=3):
    cfg = load_config(None, TINY)
    manager = CheckpointManager(tmp_path / "run", every_steps=1, keep_last=3, is_writer=True)
    meta = {"config": cfg.to_dict(), "tokenizer": {"vocab_size": 50}}
    state = {"progress": {"step": step}, "engine": engine.state_dict()}
    return manager.save(step, engine, state, meta)


def test_a_checkpoint_holds_the_ema_which_loads_as_a_model_by_the_name_ema(tmp_path):
    engine = engine_for("train.ema=0.9")
    train_steps(engine, 3)
    ckpt = save(tmp_path, engine)
    assert "ema.safetensors" in read_manifest(ckpt)["files"]
    with safe_open(str(ckpt / "ema.safetensors"), framework="pt") as fh:
        assert fh.metadata()["aiayn_ema_updates"] == "3"  # where a resume's warm-up goes on
    ema = ema_state(engine)
    for name in (tmp_path / "run" / "ema", tmp_path / "run" / "latest" / "ema", ckpt / "ema"):
        found = locate(name)
        assert found.kind == "ema" and found.checkpoint == ckpt and found.name == ckpt / "ema"
        model = build_model(load_config(None, TINY).model, 50, 0)
        load_weights(model, found)
        state = model.state_dict()
        assert all(torch.equal(state[n], t) for n, t in ema.items())
    raw = locate(tmp_path / "run")
    assert raw.kind == "checkpoint" and raw.weights == ckpt / "model.safetensors"

    # A checkpoint saved without train.ema has none to name.
    plain = engine_for()
    train_steps(plain, 1)
    ckpt = save(tmp_path / "plain", plain)
    assert "ema.safetensors" not in read_manifest(ckpt)["files"]
    with pytest.raises(CheckpointError, match="saved without train.ema"):
        locate(tmp_path / "plain" / "run" / "ema")


def test_init_optimizer_keep_refuses_the_ema(tmp_path):
    from aiayn.checkpoint.init_from import load_moments

    engine = engine_for("train.ema=0.9")
    train_steps(engine, 1)
    save(tmp_path, engine)
    with pytest.raises(CheckpointError, match="moving average"):
        load_moments(SimpleNamespace(), locate(tmp_path / "run" / "ema"), None)


def test_init_source_records_the_ema_and_finds_it_again_at_a_restart(tmp_path):
    from aiayn.train.init_source import resolve

    engine = engine_for("train.ema=0.9")
    train_steps(engine, 1)
    ckpt = save(tmp_path, engine)
    run_dir = tmp_path / "fine_tuned"
    run_dir.mkdir()
    given = str(tmp_path / "run" / "ema")
    found, record = resolve(given, run_dir)
    assert found.kind == "ema" and record["path"] == str((ckpt / "ema").resolve())
    again, _ = resolve(given, run_dir)  # a restart: from the record, not looked up again
    assert again.kind == "ema" and again.weights == found.weights == ckpt / "ema.safetensors"
