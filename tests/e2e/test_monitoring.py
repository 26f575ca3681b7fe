"""What a person watching a run sees: TensorBoard events, the live server, the log file."""

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from aiayn.config import load_config
from aiayn.train import train

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import events, free_port, metrics_file_matches_events  # tests/helpers.py
from processes import logged, wait_until  # tests/processes.py

TRAIN_TAGS = {
    "loss",
    "ppl",
    "accuracy",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "data_wait_fraction",
    "mfu",
    "memory_gib",
    "tokens",
    "loss_scale",
    "skipped_steps",
}
VALID_TAGS = {"loss", "ppl", "accuracy", "bleu", "bleu_lc"}


def overrides(run_dir, corpus, *extra):
    return tiny.overrides(
        run_dir,
        corpus,
        f"data.valid={corpus}/valid",
        f"data.test={corpus}/test",
        "train.eval_bleu=8",
        "decode.beam=1",
        "decode.max_len_b=5",
        "logging.peak_tflops=0.1",
        *extra,
    )


def test_events_hold_every_tag_with_increasing_steps(tmp_path, numbers):
    cfg = load_config(
        None,
        overrides(
            tmp_path / "run",
            numbers,
            "train.max_steps=12",
            "train.eval_every=6",
            "logging.every_steps=3",
        ),
    )
    train(cfg)
    acc = events(tmp_path / "run")
    tags = set(acc.Tags()["scalars"])
    assert {f"train/{t}" for t in TRAIN_TAGS} <= tags
    assert {f"valid/{t}" for t in VALID_TAGS} <= tags
    for tag in tags:
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)
    assert [e.step for e in acc.Scalars("train/loss")] == [3, 6, 9, 12]
    assert [e.step for e in acc.Scalars("valid/bleu")] == [6, 12]
    mfu = [e.value for e in acc.Scalars("train/mfu")]
    assert all(0 < m < 5 for m in mfu), mfu  # against a made-up 0.1 TFLOP/s peak
    assert all(0 <= e.value <= 1 for e in acc.Scalars("train/data_wait_fraction"))
    samples = acc.Tensors("valid/samples/text_summary")
    assert "**source:**" in samples[-1].tensor_proto.string_val[0].decode()
    assert acc.PluginTagToContent("hparams")  # the config with the final metrics
    lines = metrics_file_matches_events(tmp_path / "run")  # startup_s/* and hparam/* too
    assert list(lines["valid/bleu"]) == [6, 12] and "hparam/valid_bleu" in lines
    log = (tmp_path / "run" / "train.log").read_text()
    assert "parameters" in log and "train step 12 | loss" in log and "valid step 12 |" in log


def test_a_run_killed_and_resumed_has_no_duplicated_steps(tmp_path, numbers):
    """SIGKILL after step 13 was logged but the last checkpoint is step 10: the resumed run
    logs 11.. again, and TensorBoard must not show those steps twice."""
    run_dir, config = tmp_path / "run", tmp_path / "empty.yaml"
    config.write_text("")
    common = ["logging.every_steps=1", "checkpoint.every_steps=10", "train.eval_every=0"]
    args = overrides(run_dir, numbers, "train.max_steps=400", *common)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiayn", "train", "--config", str(config), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = run_dir / "train.log"
    try:
        wait_until(proc, logged(log, "train step 13 |"), 120, "training step 13", interval=0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    latest = max(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert latest == "step_00000010"
    train(
        load_config(
            None, args[:-3] + ["train.max_steps=20", "logging.every_steps=1", "train.eval_every=0"]
        )
    )
    acc = events(run_dir)
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 21))
    lines = metrics_file_matches_events(run_dir)  # lines past step 10 dropped at the restart
    assert list(lines["train/loss"]) == list(range(1, 21))
    assert list(lines["checkpoint/failed_saves"]) == [10, 20]
    assert sorted(lines["startup_s/total"]) == [1, 11]  # each start's first step
    assert "resumed from" in log.read_text()


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_the_tensorboard_server_serves_what_was_logged(tmp_path, numbers):
    cfg = load_config(
        None,
        overrides(
            tmp_path / "run",
            numbers,
            "train.max_steps=6",
            "logging.every_steps=2",
            "train.eval_every=3",
        ),
    )
    train(cfg)
    port = free_port()
    exe = Path(sys.executable).parent / "tensorboard"
    server = subprocess.Popen(
        [
            str(exe),
            "--logdir",
            str(tmp_path / "run" / "tb"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--reload_interval",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    try:

        def served_tags():
            try:
                tags = get_json(f"{base}/tags")
            except OSError:  # not listening yet
                return None
            return tags if "train/loss" in tags.get(".", {}) else None

        tags = wait_until(server, served_tags, 90, "tags served by tensorboard", interval=0.5)
        assert {f"train/{t}" for t in TRAIN_TAGS} <= set(tags["."])
        assert "valid/bleu" in tags["."]
        series = get_json(f"{base}/scalars?run=.&tag=train/loss")
        written = events(tmp_path / "run").Scalars("train/loss")
        assert [row[1] for row in series] == [e.step for e in written] == [2, 4, 6]
        assert [row[2] for row in series] == pytest.approx([e.value for e in written])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
