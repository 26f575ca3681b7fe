import contextlib
import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import aiayn.checkpoint.writer
from aiayn.checkpoint import (
    CheckpointManager,
    load_checkpoint,
    read_manifest,
    resolve_checkpoint,
)
from aiayn.checkpoint.staging import Staging
from aiayn.config import ModelConfig, load_config
from aiayn.engine.state import Weights
from aiayn.errors import CheckpointError, ConfigError, TokenizerError

CONTRACT = {"sha256": "abc", "vocab_size": 50, "pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}


class Tied(nn.Module):
    """Two names for one matrix, like a tied embedding and output projection."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.out = nn.Linear(8, 50, bias=False)
        self.out.weight = self.emb.weight


def fake_tokenizer(**changes):
    contract = {**CONTRACT, **changes}
    return SimpleNamespace(path="tok.model", contract=lambda: contract)


class Unsharded:
    """The part of the engine interface the manager uses, for a bare model."""

    def __init__(self, model):
        self.module = model

    def save_shards(self, directory):
        return []

    @contextlib.contextmanager
    def weights(self):
        yield Weights.of(self.module)

    @contextlib.contextmanager
    def ema_weights(self):
        yield None  # train.ema off


def save_meta(cfg=None) -> dict:
    return {"config": {"model": vars(cfg or ModelConfig())}, "tokenizer": CONTRACT}


def save(manager, step, model=None, cfg=None, metrics=None):
    model = model or Tied()
    meta = save_meta(cfg)
    if metrics is not None:
        meta["metrics"] = metrics
    state = {"progress": {"step": step}, "rng": torch.get_rng_state()}
    path = manager.save(step, Unsharded(model), state, meta)
    manager.join_writes()  # the retention deletes in the background
    return path


def test_save_then_load_round_trips_weights_and_state(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=10, keep_last=3, is_writer=True)
    model = Tied()
    path = save(manager, 10, model)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    manifest = read_manifest(path)
    assert set(manifest["files"]) == {"model.safetensors", "trainer.pt", "trainer.safetensors"}
    fresh = Tied()
    state, _ = load_checkpoint(path, fresh, expect_model=ModelConfig(), tokenizer=fake_tokenizer())
    torch.testing.assert_close(fresh.emb.weight, model.emb.weight, rtol=0, atol=0)
    assert fresh.out.weight is fresh.emb.weight  # tying survives
    assert state["progress"]["step"] == 10


def test_only_the_last_k_are_kept_and_latest_is_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=2, is_writer=True)
    for step in (1, 2, 3, 4):
        save(manager, step)
    assert [p.name for p in manager.checkpoints()] == ["step_00000003", "step_00000004"]
    assert manager.latest().name == "step_00000004"
    assert resolve_checkpoint(tmp_path).name == "step_00000004"
    assert resolve_checkpoint(tmp_path / "checkpoints").name == "step_00000004"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_retention_deletes_off_the_save_and_a_crash_in_it_leaves_the_kept_loadable(
    tmp_path, monkeypatch
):
    """The deletions run in a thread of their own, after save() returned; one that dies
    halfway through a checkpoint's files (a crash) leaves no half-deleted step_* folder: the
    kept checkpoints list and verify, and the next save removes what was left."""
    import aiayn.checkpoint.retention as retention

    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=1, is_writer=True)
    save(manager, 1)
    started = []

    def crash_halfway(path, ignore_errors=False):
        started.append(path.name)
        next(p for p in path.iterdir() if p.name == "model.safetensors").unlink()
        raise SystemExit("crashed")  # ends the retention thread, as a crash would

    # retention's own shutil only: the writer's removals of its folders stay real.
    monkeypatch.setattr(retention, "shutil", SimpleNamespace(rmtree=crash_halfway))
    path = manager.save(2, Unsharded(Tied()), {"progress": {"step": 2}}, save_meta())
    manager.join_writes()
    assert path.name == "step_00000002" and started == [".trash-step_00000001"]
    root = tmp_path / "checkpoints"
    assert [p.name for p in manager.checkpoints()] == ["step_00000002"]
    assert (root / ".trash-step_00000001").is_dir()  # what the crash left
    read_manifest(manager.latest())  # verified: checksums and sizes
    monkeypatch.undo()
    save(manager, 3)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_00000003"]


def test_a_corrupt_or_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=5, is_writer=True)
    save(manager, 1)
    newest = save(manager, 2)
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, one flipped bit
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert manager.latest().name == "step_00000001"
    assert "step_00000002" in caplog.text and "checksum" in caplog.text
    (newest / "trainer.pt").write_bytes(b"")  # truncated
    assert manager.latest().name == "step_00000001"


def test_a_save_interrupted_before_its_manifest_is_never_loaded(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=5, is_writer=True)
    save(manager, 1)
    # What a kill during a save leaves: a temporary dir, and even a renamed dir without manifest.
    (tmp_path / "checkpoints" / ".tmp-step_00000002-123").mkdir()
    half = tmp_path / "checkpoints" / "step_00000002"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    assert manager.latest().name == "step_00000001"
    save(manager, 3)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # cleaned up by the next save


def test_a_checkpoint_from_another_model_names_the_mismatching_fields(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=5, is_writer=True)
    path = save(manager, 1, cfg=ModelConfig(d_model=512, N=6))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, Tied(), expect_model=ModelConfig(d_model=256, N=3))
    assert "model.d_model: checkpoint 512, config 256" in str(err.value)
    assert "model.N: checkpoint 6, config 3" in str(err.value)


def test_a_tokenizer_that_does_not_match_the_contract_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=5, is_writer=True)
    path = save(manager, 1)
    with pytest.raises(TokenizerError, match="sha256: recorded 'abc', found 'zzz'"):
        load_checkpoint(path, Tied(), tokenizer=fake_tokenizer(sha256="zzz"))


def test_weights_of_another_shape_are_a_checkpoint_error(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=5, is_writer=True)
    path = save(manager, 1)
    other = nn.Linear(3, 3)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_checkpoint(path, other)


def test_missing_checkpoint_says_what_to_pass(tmp_path):
    with pytest.raises(CheckpointError, match="no valid checkpoint at"):
        resolve_checkpoint(tmp_path)


def test_manifest_records_config_and_tokenizer_contract(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=5, is_writer=True)
    path = save(manager, 7)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["tokenizer"] == CONTRACT
    assert manifest["config"]["model"]["d_model"] == 512


def test_non_writers_write_nothing(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=5, is_writer=False)
    assert save(manager, 1) is None
    assert not (tmp_path / "checkpoints").exists()


def names(manager) -> list[str]:
    return [p.name.removeprefix("step_").lstrip("0") for p in manager.checkpoints()]


def test_every_nth_step_is_kept_beside_the_last_k(tmp_path):
    manager = CheckpointManager(tmp_path, 1, keep_last=2, is_writer=True, keep_every=4)
    for step in range(1, 11):
        save(manager, step)
    assert names(manager) == ["4", "8", "9", "10"]


@pytest.mark.parametrize(
    ("metric", "higher", "best"),
    [("valid/loss", False, ["4", "5"]), ("valid/bleu", True, ["1", "6"])],
)
def test_the_best_by_the_recorded_metric_are_kept_across_restarts(tmp_path, metric, higher, best):
    values = {1: 5.0, 2: 3.0, 3: 4.0, 4: 1.0, 5: 2.0, 6: 4.5}
    for step, value in values.items():
        # A new manager each time, as after a restart: the choice comes from the manifests.
        manager = CheckpointManager(
            tmp_path, 1, 1, True, keep_best=2, best_metric=metric, higher_is_better=higher
        )
        save(manager, step, metrics={metric: value, "valid/other": -value})
    save(manager, 7)  # saved without a validation at its step: not ranked, kept as the newest
    assert names(manager) == [*best, "7"]
    assert [p.name[-1] for p in manager.best()] == best


def test_the_checkpoint_latest_names_is_never_pruned(tmp_path):
    """A run resumed from step 2 because step 3 is corrupt saves step 2 again: with keep_last=1
    the newest directory is the corrupt one, and the fresh save must survive beside it."""
    manager = CheckpointManager(tmp_path, 1, keep_last=1, is_writer=True)
    save(manager, 3)
    (tmp_path / "checkpoints" / "step_00000003" / "trainer.pt").write_bytes(b"")
    save(manager, 2)
    assert names(manager) == ["2", "3"]
    assert manager.latest().name == "step_00000002"


def test_retention_settings_are_checked(tmp_path):
    base = ["data.train=x", "data.valid=y", "checkpoint.every_steps=100"]
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [*base, "checkpoint.keep_every=150", "checkpoint.keep_best=2",
             "train.eval_every=50", "checkpoint.best_metric=valid/blue"],
        )  # fmt: skip
    text = str(err.value)
    assert "checkpoint.keep_every (150) must be a multiple of checkpoint.every_steps (100)" in text
    assert "train.eval_every (50) must be a multiple of checkpoint.every_steps (100)" in text
    assert "did you mean valid/bleu?" in text
    cfg = load_config(
        None, [*base, "checkpoint.keep_best=2", "train.eval_every=200", "checkpoint.keep_every=300"]
    )
    assert cfg.checkpoint.higher_is_better is False
    cfg = load_config(None, [*base, "checkpoint.best_metric=valid/bleu"])
    assert cfg.checkpoint.higher_is_better is True


def test_async_save_writes_what_the_state_was_when_save_returned(tmp_path):
    """The background write works on a host copy: changing the model and the optimizer state
    in place right after save() (as the next step does) does not reach the checkpoint."""
    manager = CheckpointManager(tmp_path, 1, 5, is_writer=True, async_save=True)
    model = Tied()
    moments = torch.arange(1000.0)
    meta = {"config": {"model": vars(ModelConfig())}, "tokenizer": CONTRACT}
    expected_weights = model.emb.weight.detach().clone()
    path = manager.save(3, Unsharded(model), {"engine": {"exp_avg": moments}}, meta)
    with torch.no_grad():
        model.emb.weight.add_(1.0)
    moments.mul_(-1)
    manager.wait()
    fresh = Tied()
    state, _ = load_checkpoint(path, fresh, expect_model=ModelConfig(), tokenizer=fake_tokenizer())
    assert torch.equal(fresh.emb.weight, expected_weights)
    assert torch.equal(state["engine"]["exp_avg"], torch.arange(1000.0))
    assert manager.latest() == path


def test_async_saves_reuse_their_host_buffers_and_each_writes_its_own_state(tmp_path):
    """The second save copies into the first one's buffers (no fresh host memory per save,
    checkpoint/staging.py), after the first write has finished: both checkpoints hold their
    own step's state."""
    manager = CheckpointManager(tmp_path, 1, 5, is_writer=True, async_save=True)
    model = Tied()
    moments = torch.arange(1000.0)
    meta = {"config": {"model": vars(ModelConfig())}, "tokenizer": CONTRACT}
    paths, weights = [], []
    for step in (1, 2):
        weights.append(model.emb.weight.detach().clone())
        state = {"engine": {"exp_avg": moments, "step": step}, "note": ["kept", step]}
        paths.append(manager.save(step, Unsharded(model), state, meta))
        buffers = [id(b) for b in manager._writer._staging._buffers]
        if step == 1:
            first_buffers = buffers
        with torch.no_grad():
            model.emb.weight.add_(1.0)
        moments.add_(1.0)
    assert buffers == first_buffers and len(buffers) == 2  # the weight (tied: once), exp_avg
    manager.wait()
    for step, path, expected in zip((1, 2), paths, weights, strict=True):
        fresh = Tied()
        state, _ = load_checkpoint(
            path, fresh, expect_model=ModelConfig(), tokenizer=fake_tokenizer()
        )
        assert torch.equal(fresh.emb.weight, expected)
        assert torch.equal(state["engine"]["exp_avg"], torch.arange(1000.0) + step - 1)
        assert state["engine"]["step"] == step and state["note"] == ["kept", step]


def test_staging_copies_into_kept_buffers_and_replaces_one_whose_shape_changed():
    staging = Staging()
    a, b = torch.arange(6.0).view(2, 3).t(), torch.ones(4, dtype=torch.bfloat16)  # a: strided
    staging.begin()
    tree = staging.copy_tree({"a": a, "rest": (b, 7, "x")})
    assert staging.end() is None  # on a CPU the copies are done when copy() returns
    assert torch.equal(tree["a"], a) and tree["a"].is_contiguous()
    assert tree["rest"][0].dtype == torch.bfloat16 and tree["rest"][1:] == (7, "x")
    a.add_(1)
    assert torch.equal(tree["a"], a - 1)  # a copy, not a view
    kept = [id(t) for t in staging._buffers]
    staging.begin()
    again = staging.copy_tree({"a": a, "rest": (torch.ones(5, dtype=torch.bfloat16), 7, "x")})
    assert id(again["a"]) == kept[0] and torch.equal(again["a"], a)
    assert id(again["rest"][0]) != kept[1] and again["rest"][0].shape == (5,)
    staging.guard()  # nothing to wait for on a CPU


def test_a_failed_background_write_is_reported_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    manager = CheckpointManager(tmp_path, 1, 5, is_writer=True, async_save=True)
    first = save(manager, 1)
    manager.wait()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("aiayn.checkpoint.writer.write_slices", disk_full)
    save(manager, 2)  # returns at once; the write fails in the background
    with pytest.raises(CheckpointError, match="step 2 was not written: no space left on device"):
        manager.wait()  # the newest save failed: a run ending here must not report success
    assert manager.latest() == first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", first.name]


def test_failed_saves_are_retried_until_max_failed_saves_in_a_row(tmp_path, monkeypatch):
    """A failed synchronous save removes its partial directory and lets training go on; a
    success resets the count; the max_failed_saves-th failure in a row stops the run."""
    manager = CheckpointManager(tmp_path, 1, 5, is_writer=True, max_failed_saves=2)
    first = save(manager, 1)
    real_save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"part of it")  # what fitted, before the disk filled
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr("aiayn.checkpoint.writer.torch.save", disk_full)
    assert save(manager, 2) is None
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", first.name]
    assert manager.failures.steps == [2]
    monkeypatch.setattr("aiayn.checkpoint.writer.torch.save", real_save)
    third = save(manager, 3)
    assert manager.latest() == third and manager.failures.steps == []
    monkeypatch.setattr("aiayn.checkpoint.writer.torch.save", disk_full)
    assert save(manager, 4) is None
    with pytest.raises(CheckpointError, match=r"2 checkpoint saves in a row failed \(steps 4, 5;"):
        save(manager, 5)
    assert sorted(p.name for p in root.iterdir()) == ["latest", first.name, third.name]
    assert (root / "latest").read_text().strip() == third.name


def test_a_checkpoint_whose_pointer_could_not_be_written_is_removed(tmp_path, monkeypatch):
    """A resume takes the newest valid directory, so a complete one that `latest` does not name
    (its write failed) would be resumed from instead of the previous checkpoint."""
    manager = CheckpointManager(tmp_path, 1, 5, is_writer=True)
    first = save(manager, 1)
    real = aiayn.checkpoint.writer.write_atomic

    def full_for_latest(path, data):
        if path.name == "latest":
            raise OSError(28, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr("aiayn.checkpoint.writer.write_atomic", full_for_latest)
    assert save(manager, 2) is None
    assert manager.latest() == first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", first.name]
    with pytest.raises(CheckpointError, match="step 2 was not written.*step_00000001 is intact"):
        manager.wait()


def test_a_resume_whose_steps_take_another_batch_says_so(caplog):
    """train.grad_accum resumed on another world size changes the step's tokens under the same
    schedule: the log says so and names the setting that keeps it; tokens_per_step does not."""
    from aiayn.checkpoint.resume import _warn_of_another_batch

    grown = {"config": {"train": {"max_tokens": 600, "grad_accum": 2}}, "world_size": 2}
    fixed = {"config": {"train": {"max_tokens": 600, "tokens_per_step": 2400}}, "world_size": 2}
    per_rank = load_config(None, ["data.train=x", "train.max_tokens=600", "train.grad_accum=2"])
    per_step = load_config(
        None, ["data.train=x", "train.max_tokens=600", "train.tokens_per_step=2400"]
    )
    with caplog.at_level(logging.WARNING, logger="aiayn.checkpoint.resume"):
        _warn_of_another_batch(per_rank.train, 2, grown)  # the same world size
        _warn_of_another_batch(per_step.train, 4, fixed)  # another, the same batch
        _warn_of_another_batch(per_step.train, 1, grown)  # tokens_per_step keeps the old batch
        assert caplog.text == ""
        _warn_of_another_batch(per_rank.train, 1, grown)
    assert "took 2,400 tokens over 2 rank(s), this run's take 1,200 over 1" in caplog.text
    assert "set train.tokens_per_step=2400 (and train.grad_accum=null)" in caplog.text


def test_each_rank_reads_its_own_rng_state_from_the_one_file(tmp_path):
    """Rank 0 writes every rank's RNG streams; rank r gets back exactly its own, which
    draws the same numbers; a rank past the saved world size gets none."""
    import random

    import numpy as np

    from aiayn.checkpoint import rng_file
    from aiayn.runtime.seeding import load_rng_state, rng_state, seed_everything

    states, draws = [], []
    for rank in range(3):
        seed_everything(rank)
        random.gauss(0, 1)  # a cached Gaussian in Python's state: its float must survive
        states.append(rng_state())
        draws.append((random.gauss(0, 1), np.random.rand(), torch.rand(2).tolist()))
    (tmp_path / rng_file.RNG_FILE).write_bytes(rng_file.encode(states))
    for rank in range(3):
        world, mine = rng_file.read_own(tmp_path, rank)
        load_rng_state(mine)
        assert world == 3
        assert (random.gauss(0, 1), np.random.rand(), torch.rand(2).tolist()) == draws[rank]
    assert rng_file.read_own(tmp_path, 3) == (3, None)


def test_the_counter_sees_opens_and_listings_under_the_watched_folder_only(tmp_path):
    """What the save and restart log lines count (runtime/io_counts.py): opens and listings
    under a run's checkpoints/ (a library's too: DeepSpeed's torch.load, its glob), nothing
    elsewhere."""
    import glob

    from aiayn.runtime import io_counts

    watched = tmp_path / "checkpoints"
    watched.mkdir()
    io_counts.watch(watched)
    before = io_counts.counts()
    (watched / "a.pt").write_bytes(b"x")
    (tmp_path / "elsewhere").write_bytes(b"x")
    os.close(os.open(watched / "a.pt", os.O_RDONLY))
    glob.glob(str(watched / "*.pt"))
    sorted(tmp_path.iterdir())
    got = io_counts.since(before)
    assert (got["opens"], got["listings"], got["stats"]) == (2, 1, 0), got

    # The retention's thread is not counted (io_counts.uncounted), while the others are.
    def retention() -> None:
        with io_counts.uncounted():
            (watched / "old.pt").write_bytes(b"x")
            glob.glob(str(watched / "*.pt"))
            io_counts.exists(watched / "old.pt")
        io_counts.exists(watched / "old.pt")  # after the block: counted again

    import threading

    before = io_counts.counts()
    thread = threading.Thread(target=retention)
    thread.start()
    thread.join()
    os.close(os.open(watched / "a.pt", os.O_RDONLY))
    got = io_counts.since(before)
    assert (got["opens"], got["listings"], got["stats"]) == (1, 0, 1), got
