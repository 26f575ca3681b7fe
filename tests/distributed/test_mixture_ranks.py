"""A mixture of sources (data.sources) trained by real processes, on the token cache and
streamed: a run SIGKILLed mid-epoch and resumed on another world size, twice (1 -> 2 -> 1), takes
the same (source, example) pairs at every step as a run that was never interrupted, across a
pass boundary of a small source and an epoch boundary.

One process with train.grad_accum=2 takes the same global batches per step as 2 ranks with 1
(rank r takes global batches r, r + W, ...), so the runs are compared step by step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.config import TokenizerConfig
from aiayn.corpora import demo
from aiayn.tokenizer import train_tokenizer

from helpers import TINY_MODEL, model_yaml, torchrun  # tests/helpers.py
from procs import ENV, run  # tests/distributed/procs.py

pytestmark = pytest.mark.distributed
FAULTY = str(Path(__file__).with_name("faulty.py"))
STEPS = 12
# Killed on 1 rank at step 6 (resumed from the save at 4), on 2 at step 10 (from the save at 8):
# steps 5, 6 and 9, 10 are redone.
KILLS = ((1, 6, 4), (2, 10, 8))  # (world size, killed at, resumed from)
SIZES = {"big": 300, "bt": 120, "small": 40}
EPOCH = 200  # examples: big 100, bt 50, small 50 (1.25 passes)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixture")
    corpora = {
        name: demo.write_numbers(root / name, n_train=n, n_valid=4, n_test=2, seed=i + 1)
        for i, (name, n) in enumerate(SIZES.items())
    }
    sents = [
        line
        for d in corpora.values()
        for side in ("en", "de")
        for line in (d / f"train.{side}").read_text().splitlines()
    ]
    tok_cfg = TokenizerConfig(vocab_size=100, user_symbols=["<bt>"])
    train_tokenizer(tok_cfg, sents, root / "spm.model")
    path = root / "mix.yaml"
    path.write_text(
        f"""
model: {model_yaml(TINY_MODEL, dropout=0.0)}
tokenizer: {{path: {root}/spm.model, vocab_size: 100}}
data:
  sources:
    - {{name: big, path: {corpora["big"]}/train, weight: 2}}
    - {{name: bt, path: {corpora["bt"]}/train, weight: 1, tag: "<bt>"}}
    - {{name: small, path: {corpora["small"]}/train, weight: 1}}
  src_lang: en
  tgt_lang: de
  max_len: 40
  shuffle_buffer: 200
  epoch: examples
  epoch_size: {EPOCH}
  cache_dir: {root}/cache
train: {{max_steps: {STEPS}, max_tokens: 300, eval_every: 0}}
schedule: {{warmup: 10}}
logging: {{every_steps: 1, record_ids: true, peak_tflops: 1}}
checkpoint: {{every_steps: 4}}
"""
    )
    return path


def launcher(world: int) -> tuple[list[str], tuple[str, ...]]:
    """How W ranks are started, and the grad_accum that keeps the global batch of 2."""
    if world == 1:
        return [sys.executable], ("train.grad_accum=2",)
    return torchrun(world), ()


PATHS = {"cache": "data.cache=true", "stream": "data.cache=false"}


def train(config: Path, run_dir: Path, world: int, path: str, kill_at: int | None = None) -> None:
    start, options = launcher(world)
    cmd = ["train", "--config", str(config), f"run_dir={run_dir}", PATHS[path], *options]
    if kill_at is None:
        run(start + ["-m", "aiayn", *cmd])
        return
    proc = subprocess.run(
        start + [FAULTY, "sigkill", "0", str(kill_at), *cmd], env=ENV, capture_output=True
    )
    assert proc.returncode != 0  # killed, as asked


def records(run_dir: Path, skip: dict[str, int] | None = None) -> list[dict]:
    """The rows of logging.record_ids, every rank's, after the first skip[file] lines."""
    rows = []
    for path in sorted((run_dir / "consumed").glob("rank_*.jsonl")):
        lines = path.read_text().splitlines()[(skip or {}).get(path.name, 0) :]
        rows += [json.loads(line) for line in lines]
    return rows


def by_step(rows: list[dict]) -> dict[int, list[tuple[int, int]]]:
    """Step -> the sorted (source, example) pairs all ranks trained on in it."""
    out: dict[int, list] = {}
    for row in rows:
        out.setdefault(row["step"], []).extend(zip(row["sources"], row["ids"], strict=True))
    return {step: sorted(pairs) for step, pairs in out.items()}


@pytest.fixture(scope="module")
def straight(config, tmp_path_factory):
    """Uninterrupted runs on one process, one per path, made when first asked for."""
    made: dict[str, list[dict]] = {}

    def get(path: str) -> list[dict]:
        if path not in made:
            run_dir = tmp_path_factory.mktemp(f"straight_{path}")
            train(config, run_dir, 1, path)
            made[path] = records(run_dir)
        return made[path]

    return get


@pytest.mark.parametrize("path", list(PATHS))
def test_the_uninterrupted_run_crosses_an_epoch_and_passes_of_the_small_source(straight, path):
    rows = straight(path)
    steps = by_step(rows)
    epoch_at = {r["step"]: r["epoch"] for r in rows}
    last = KILLS[-1][2]
    assert epoch_at[last] == epoch_at[last + 1]  # the last resume point is inside an epoch
    assert epoch_at[STEPS] > epoch_at[last + 1]  # and the resumed steps reach the next
    small = sum(src == 2 for s in range(1, STEPS + 1) for src, _ in steps[s])
    before = sum(src == 2 for s in range(1, last + 1) for src, _ in steps[s])
    # The small source's 40 examples are passed over again after the resume point.
    assert before // 40 < small // 40


@pytest.mark.parametrize("path", list(PATHS))
def test_a_run_killed_mid_epoch_resumes_on_another_world_size_with_the_same_pairs(
    config, straight, tmp_path, path
):
    """Killed on 1 rank, resumed on 2 and killed again, resumed on 1 to the end."""
    run_dir, ref = tmp_path / "run", by_step(straight(path))
    taken: dict[int, list] = {}  # step -> the pairs of its last run
    first = 1
    for world, killed_at, resumed_from in (*KILLS, (1, None, None)):  # then to the end
        done = {p.name: len(p.read_text().splitlines()) for p in run_dir.glob("consumed/*")}
        train(config, run_dir, world, path, kill_at=killed_at)
        steps = by_step(records(run_dir, skip=done))
        # a step's examples are recorded as it begins, where faulty.py kills it
        assert sorted(steps) == list(range(first, (killed_at or STEPS) + 1)), sorted(steps)
        taken |= steps
        if killed_at is not None:
            (run_dir / "injected.jsonl").unlink()  # faulty.py: the next launch's fault is its first
            first = resumed_from + 1
    assert sorted(taken) == list(range(1, STEPS + 1))
    assert all(taken[s] == ref[s] for s in ref)
    log = (run_dir / "train.log").read_text()
    for _, _, resumed_from in KILLS:
        assert f"resuming from {run_dir}/checkpoints/step_{resumed_from:08d}" in log
    assert log.count(STARTUP[path]) == 3  # a line per source at each start


STARTUP = {
    "cache": "source small: weight 1, share 25.0%, 40 examples, 50 per epoch (1.25 passes)",
    "stream": "source small: weight 1, share 25.0%, 50 per epoch (size unknown: streamed)",
}
