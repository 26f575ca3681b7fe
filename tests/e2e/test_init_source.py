"""init.source: a run that starts from a trained model's weights (fine-tuning, or continuing
with new settings). The weights only: the step, schedule and max_steps start fresh. The model's
shape and the tokenizer come from the source; a conflicting field or tokenizer is refused by
name. Restarts never re-initialise: a fine-tune killed before its first save starts again from
the checkpoint recorded at its first start, even after the source run has saved a newer one;
one killed after it resumes its own checkpoint bitwise; a run_dir is refused another source.
An export used as the source gives the export's logits bitwise."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn.checkpoint.average import export, export_module
from aiayn.checkpoint.inference import load_for_inference
from aiayn.checkpoint.init_from import load_weights
from aiayn.config import keys_set, load_config
from aiayn.errors import CheckpointError, ConfigError, TokenizerError
from aiayn.model import build_model, vocab_parameters
from aiayn.tokenizer import Tokenizer, train_tokenizer
from aiayn.train import init_source, train

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import TINY_MODEL, model_overrides, scalars, weights_at  # tests/helpers.py
from processes import kill_tree, logged, wait_until  # tests/processes.py

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMON = ("train.threads=1", "logging.every_steps=1", "logging.peak_tflops=0.1")


def source_overrides(run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    return tiny.overrides(run_dir, corpus, *COMMON, "checkpoint.every_steps=10", *extra)


def tune_overrides(run_dir: Path, corpus: Path, source, *extra: str) -> list[str]:
    """A fine-tune's: no model shape and no tokenizer settings (the source's are used)."""
    return [
        f"run_dir={run_dir}",
        f"init.source={source}",
        f"data.train={corpus}/train",
        "data.src_lang=en",
        "data.tgt_lang=de",
        "data.max_len=40",
        "train.max_tokens=800",
        "schedule.warmup=10",
        *COMMON,
        *extra,
    ]


def start(overrides: list[str]) -> dict:
    return train(load_config(None, overrides), keys_set(None, overrides))


def command(overrides: list[str], tmp_path: Path) -> list[str]:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    return [sys.executable, "-m", "aiayn", "train", "--config", str(empty), *overrides]


def kill_at_step(overrides: list[str], tmp_path: Path, run_dir: Path, step: int) -> None:
    """`aiayn train` in a process of its own, SIGKILLed once it has logged `step`."""
    proc = subprocess.Popen(
        command(overrides, tmp_path), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(proc, logged(run_dir / "train.log", f"train step {step} "), 120, f"step {step}")
    finally:
        kill_tree(proc)


@pytest.fixture(scope="module")
def source(tmp_path_factory, numbers) -> Path:
    """A trained tiny model: 60 steps, a checkpoint every 10."""
    run_dir = tmp_path_factory.mktemp("init") / "source"
    start(source_overrides(run_dir, numbers, "train.max_steps=60"))
    return run_dir


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, numbers, source) -> Path:
    """A fine-tune of 10 steps from the source run's latest checkpoint (step 60)."""
    run_dir = tmp_path_factory.mktemp("init") / "tuned"
    extra = (
        "train.max_steps=10",
        "checkpoint.every_steps=5",
        "train.label_smoothing=0.0",
        f"data.valid={numbers}/valid",
        "train.eval_every=5",
        "train.eval_bleu=0",
        "checkpoint.keep_best=1",
    )
    start(tune_overrides(run_dir, numbers, source, *extra))
    return run_dir


def test_a_fine_tune_starts_from_the_weights_with_its_own_step_and_schedule(
    tuned, source, numbers, tmp_path
):
    scratch = tmp_path / "scratch"
    start(source_overrides(scratch, numbers, "train.max_steps=1"))
    first, trained = scalars(tuned, "train/loss")[1], scalars(source, "train/loss")[60]
    # The source's loss, not a new model's: far below the loss of step 1 from scratch.
    scratch_first = scalars(scratch, "train/loss")[1]
    assert first < 0.8 * scratch_first, (first, scratch_first)
    assert abs(first - trained) < 0.3 * trained, (first, trained)
    # Its own steps: max_steps counts them, and the schedule's warmup starts again.
    assert sorted(p.name for p in (tuned / "checkpoints").glob("step_*")) == [
        "step_00000005",
        "step_00000010",
    ]
    assert scalars(tuned, "train/lr")[1] == scalars(scratch, "train/lr")[1]  # same d_model, warmup
    cfg = load_config(tuned / "config.yaml")
    # The shape and the tokenizer are the source's; the tokenizer is copied into the run.
    assert cfg.model.d_model == 32 and cfg.model.N == 1
    assert (
        Tokenizer(tuned / "tokenizer" / "spm.model").sha256
        == Tokenizer(load_config(source / "config.yaml").tokenizer_path).sha256
    )
    # The best checkpoint is ranked among this run's own: the source's best is not carried.
    best = (tuned / "checkpoints" / "best").read_text().strip()
    assert best in ("step_00000005", "step_00000010"), best
    # What differs from the source's settings is said once, at the start.
    log = (tuned / "train.log").read_text()
    assert "init.source: train.label_smoothing: 0.1 in the source, 0.0 here" in log


def test_a_source_that_is_not_there_is_named(numbers, tmp_path):
    with pytest.raises(CheckpointError, match=r"no valid checkpoint at .*nowhere: pass a run_dir"):
        start(tune_overrides(tmp_path / "run", numbers, tmp_path / "nowhere"))


def test_every_checkpoint_records_where_the_run_started(tuned, source):
    manifest = json.loads((tuned / "checkpoints" / "step_00000010" / "manifest.json").read_text())
    init = manifest["init"]
    assert init["given"] == str(source)
    assert init["path"] == str((source / "checkpoints" / "step_00000060").resolve())
    assert init["kind"] == "checkpoint" and init["step"] == 60
    assert "optimizer" in init["reset"] and len(init["sha256"]) == 64
    recorded = json.loads((tuned / "init_source.json").read_text())
    assert recorded["sha256"] == init["sha256"]


def test_a_conflicting_shape_or_tokenizer_is_refused_by_name(source, numbers, tmp_path):
    with pytest.raises(ConfigError, match=r"model.d_model: init.source has 32, this config 48"):
        start(tune_overrides(tmp_path / "wide", numbers, source, "model.d_model=48"))
    # The same values as the source's are no conflict.
    other = tmp_path / "other.model"
    cfg = load_config(None, source_overrides(tmp_path / "x", numbers, "tokenizer.vocab_size=90"))
    train_tokenizer(cfg.tokenizer, (numbers / "train.en").read_text().splitlines(), other)
    with pytest.raises(TokenizerError, match=r"vocab_size: recorded 100, found"):
        start(tune_overrides(tmp_path / "tok", numbers, source, f"tokenizer.path={other}"))


def test_an_export_as_the_source_gives_its_logits_bitwise(source, tmp_path):
    weights = export(source, tmp_path / "model.safetensors", dtype="fp32")
    cfg = load_config(None, tune_overrides(tmp_path / "run", tmp_path, weights))
    (tmp_path / "run").mkdir()
    found, record = init_source.resolve(str(weights), tmp_path / "run")
    assert record["kind"] == "export" and record["step"] == 60
    merged, _ = init_source.with_source(cfg, record, frozenset())
    tok = Tokenizer(found.tokenizer)
    model = build_model(merged.model, tok.vocab_size, tok.pad_id)
    load_weights(model, found)
    _, exported, _, _ = load_for_inference(weights, (), "cpu")
    src = torch.tensor([tok.encode(["three hundred four"])[0] + [tok.eos_id]])
    tgt = torch.tensor([[tok.bos_id] + tok.encode(["drei"])[0]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(src, tgt), exported(src, tgt))


def test_a_run_dir_belongs_to_one_source(tuned, source, tmp_path):
    weights = export(source, tmp_path / "model.safetensors", dtype="fp32")
    with pytest.raises(CheckpointError, match=r"started from init.source=.*, not .*model"):
        start(tune_overrides(tuned, tmp_path, weights, "train.max_steps=12"))
    with pytest.raises(CheckpointError, match=r"trained from scratch, not from init.source"):
        start(tune_overrides(source, tmp_path, weights, "train.max_steps=70"))


def test_a_restart_before_the_first_save_uses_the_recorded_checkpoint(tmp_path, numbers):
    src = tmp_path / "source"
    start(source_overrides(src, numbers, "train.max_steps=20"))
    run_dir = tmp_path / "tune"
    overrides = tune_overrides(
        run_dir, numbers, src, "train.max_steps=30", "checkpoint.every_steps=1000"
    )
    kill_at_step(overrides, tmp_path, run_dir, 2)
    assert not list((run_dir / "checkpoints").glob("step_*"))
    start(source_overrides(src, numbers, "train.max_steps=30"))  # the source moves on to 30
    start(overrides)  # starts again: from step 20, as recorded, not the source's latest
    log = (run_dir / "train.log").read_text().split("init.source=")[-1]
    assert "step_00000020" in log and "step 20" in log
    assert (
        json.loads((run_dir / "checkpoints" / "step_00000030" / "manifest.json").read_text())[
            "init"
        ]["step"]
        == 20
    )

    # A recorded source that is gone, for a run without a checkpoint of its own, is an error.
    again = tmp_path / "tune2"
    overrides = tune_overrides(again, numbers, src, "train.max_steps=30")
    (again).mkdir()
    init_source.resolve(str(src), again)  # what the first start records
    (src / "checkpoints" / "step_00000030" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"source this run started from"):
        start(overrides)


def test_a_fine_tune_killed_after_its_first_save_resumes_bitwise(source, numbers, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    extra = ("train.max_steps=16", "checkpoint.every_steps=8", "train.deterministic=true")
    start(tune_overrides(straight, numbers, source, *extra))
    overrides = tune_overrides(killed, numbers, source, *extra)
    kill_at_step(overrides, tmp_path, killed, 10)
    start(overrides)
    log = (killed / "train.log").read_text()
    assert "not loaded: the run resumes its own checkpoint" in log
    a, b = weights_at(straight, 16), weights_at(killed, 16)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_excluded_parameters_start_fresh_and_frozen_ones_stay_the_sources(
    source, numbers, tmp_path
):
    # init.exclude: the decoder as a new model of the same seed has it, the rest the source's.
    cfg = load_config(None, tune_overrides(tmp_path / "x", numbers, source))
    (tmp_path / "x").mkdir()
    found, record = init_source.resolve(str(source), tmp_path / "x")
    merged, _ = init_source.with_source(cfg, record, frozenset())
    tok = Tokenizer(found.tokenizer)
    torch.manual_seed(3)
    fresh = build_model(merged.model, tok.vocab_size, tok.pad_id).state_dict()
    torch.manual_seed(3)
    model = build_model(merged.model, tok.vocab_size, tok.pad_id)
    left = load_weights(model, found, ["decoder.*"])["fresh"]
    trained = load_file(found.weights)
    got = model.state_dict()
    decoder = [k for k in got if k.startswith("decoder.")]
    assert decoder and left == sum(
        got[k].numel() for k in decoder if k.endswith(("weight", "bias"))
    )
    assert all(torch.equal(got[k], fresh[k]) for k in decoder)
    assert all(torch.equal(got[k], trained[k]) for k in trained if not k.startswith("decoder."))
    with pytest.raises(ConfigError, match=r"init.exclude: 'decodr.\*' names no parameter"):
        load_weights(model, found, ["decodr.*"])

    # train.freeze: the encoder ends where the source left it; the decoder trains.
    run_dir = tmp_path / "frozen"
    start(
        tune_overrides(run_dir, numbers, source, "train.max_steps=5", 'train.freeze=["encoder.*"]')
    )
    after = weights_at(run_dir, 5)
    encoder = [k for k in after if k.startswith("encoder.")]
    assert encoder and all(torch.equal(after[k], trained[k]) for k in encoder)
    assert not all(torch.equal(after[k], trained[k]) for k in after if k.startswith("decoder."))
    assert "train.freeze: " in (run_dir / "train.log").read_text()
    with pytest.raises(ConfigError, match=r"train.freeze: 'encodr.\*' names no parameter"):
        start(tune_overrides(tmp_path / "typo", numbers, source, 'train.freeze=["encodr.*"]'))


@pytest.mark.parametrize("sharing", ["all", "decoder", "none"])
def test_remap_copies_the_rows_of_shared_pieces_by_string(numbers, tmp_path, sharing):
    lines = [
        *(numbers / "train.en").read_text().splitlines(),
        *(numbers / "train.de").read_text().splitlines(),
    ]
    extra = ["zebra quantum walrus", "quantum zebra"] * 200  # pieces the source never saw
    base = load_config(None, tune_overrides(tmp_path / "r", numbers, "x"))
    s_path, t_path = tmp_path / "s.model", tmp_path / "t.model"
    train_tokenizer(dataclasses.replace(base.tokenizer, vocab_size=100), lines, s_path)
    train_tokenizer(dataclasses.replace(base.tokenizer, vocab_size=90), lines[::2] + extra, t_path)
    s_tok, t_tok = Tokenizer(s_path), Tokenizer(t_path)
    shape = model_overrides(TINY_MODEL)
    src_cfg = load_config(
        None, source_overrides(tmp_path / "s", numbers, *shape, f"model.share_embeddings={sharing}")
    )
    torch.manual_seed(1)
    source_model = build_model(src_cfg.model, s_tok.vocab_size, s_tok.pad_id)
    weights = export_module(source_model, src_cfg.to_dict(), s_tok, tmp_path / "source.safetensors")

    (tmp_path / "run").mkdir()
    overrides = tune_overrides(
        tmp_path / "run", numbers, weights, "init.vocab=remap", f"tokenizer.path={t_path}"
    )
    cfg = load_config(None, overrides)
    found, record = init_source.resolve(str(weights), tmp_path / "run")
    merged, _ = init_source.with_source(cfg, record, keys_set(None, overrides))
    assert merged.model.share_embeddings == sharing and merged.tokenizer.path == str(t_path)
    torch.manual_seed(2)
    fresh = build_model(merged.model, t_tok.vocab_size, t_tok.pad_id)
    torch.manual_seed(2)
    model = build_model(merged.model, t_tok.vocab_size, t_tok.pad_id)
    counts = load_weights(model, found, remap=(s_tok, t_tok))

    by_piece = {s_tok.sp.id_to_piece(i): i for i in range(s_tok.vocab_size)}
    kept = new = 0
    pairs = list(
        zip(
            vocab_parameters(model),
            vocab_parameters(source_model),
            vocab_parameters(fresh),
            strict=True,
        )
    )
    assert len(pairs) == {"all": 1, "decoder": 2, "none": 3}[sharing]
    for ours, theirs, untouched in pairs:
        for j in range(t_tok.vocab_size):
            piece = t_tok.sp.id_to_piece(j)
            i = j if j < 4 else by_piece.get(piece)  # the specials by role
            if i is None:
                new += 1
                assert torch.equal(ours[j], untouched[j]), piece
            else:
                kept += 1
                assert torch.equal(ours[j], theirs[i]), piece
    assert counts["pieces_kept"] * len(pairs) == kept and counts["pieces_new"] * len(pairs) == new
    assert counts["pieces_new"] >= 3 and counts["pieces_kept"] >= 30, counts
    # every other tensor is the source's
    other = {k: v for k, v in source_model.state_dict().items() if v.shape[0] != s_tok.vocab_size}
    got = model.state_dict()
    assert other and all(torch.equal(got[k], v) for k, v in other.items())
    if sharing == "all":  # and through a run: its log and every checkpoint say what was kept
        start([*overrides, "train.max_steps=2"])
        log = (tmp_path / "run" / "train.log").read_text()
        assert f"init.vocab=remap: {counts['pieces_kept']} of this tokenizer's 90 pieces" in log
        manifest = tmp_path / "run" / "checkpoints" / "step_00000002" / "manifest.json"
        assert json.loads(manifest.read_text())["init"]["pieces_new"] == counts["pieces_new"]


def test_kept_moments_make_the_first_step_the_sources_next(source, tmp_path):
    # Every batch alike (one sentence pair, repeated) and a constant rate: the source's step 4
    # and a continuation of its step 3 see the same batch at the same rate, so with Adam's
    # moments and step count kept they make the same update, bit for bit.
    corpus = tmp_path / "same"
    corpus.mkdir()
    (corpus / "train.en").write_text("three hundred four\n" * 4000)
    (corpus / "train.de").write_text("dreihundertvier\n" * 4000)
    tokenizer = load_config(source / "config.yaml").tokenizer_path
    alike = (
        f"tokenizer.path={tokenizer}",
        "schedule.kind=constant",
        "schedule.lr=0.001",
        "model.dropout=0",
        "checkpoint.every_steps=1",
        "data.shuffle_buffer=0",  # no windows: every batch full, so no sum runs in other order
    )
    trained = tmp_path / "trained"
    start(source_overrides(trained, corpus, *alike, "train.max_steps=4"))
    step3 = trained / "checkpoints" / "step_00000003"

    def continued(name: str, optimizer: str) -> dict:
        run_dir = tmp_path / name
        extra = (*alike, "train.max_steps=1", f"init.optimizer={optimizer}")
        start(tune_overrides(run_dir, corpus, step3, *extra))
        return weights_at(run_dir, 1)

    expected = weights_at(trained, 4)
    kept = continued("kept", "keep")
    assert all(torch.equal(kept[k], expected[k]) for k in expected)
    fresh = continued("reset", "reset")  # Adam from zero moments takes another step
    assert not all(torch.equal(fresh[k], expected[k]) for k in expected)

    # Refused, saying why: a source without optimizer state, another set of trained parameters
    averaged = export(trained, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"takes Adam's moments from a training checkpoint"):
        start(tune_overrides(tmp_path / "e", corpus, averaged, *alike, "init.optimizer=keep"))
    with pytest.raises(CheckpointError, match=r"the source trained with train.freeze=\[\]"):
        start(
            tune_overrides(
                tmp_path / "f",
                corpus,
                step3,
                *alike,
                "init.optimizer=keep",
                'train.freeze=["encoder.*"]',
            )
        )
