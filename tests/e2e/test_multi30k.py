"""The real corpus: Multi30k from ../shared/data/multi30k (skipped where it is absent)."""

import os

import pytest

from aiayn.config import load_config
from aiayn.data import open_split
from aiayn.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MULTI30K = os.path.join(os.path.dirname(ROOT), "shared", "data", "multi30k")
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MULTI30K, "train.de.gz")),
    reason=f"Multi30k not found at {MULTI30K} (shared data beside the project)",
)


def config(project_root, tmp_path, *overrides):
    return load_config(
        os.path.join(project_root, "configs", "multi30k_de_en.yaml"),
        [f"data.train={MULTI30K}/train", f"data.valid={MULTI30K}/val",
         f"data.test={MULTI30K}/test_2016_flickr", f"run_dir={tmp_path}/run",
         f"tokenizer.path={tmp_path}/spm.model", *overrides],
    )  # fmt: skip


def test_the_shipped_config_reads_every_gzipped_pair(project_root, tmp_path):
    cfg = config(project_root, tmp_path)
    assert sum(1 for _ in open_split(cfg.data, cfg.data.train, "seq2seq")) == 29_000
    val = list(open_split(cfg.data, cfg.data.valid, "seq2seq"))
    assert len(val) == 1014
    assert val[0]["src"].startswith("Eine Gruppe von Männern") and val[0]["tgt"].startswith(
        "A group"
    )


def test_a_few_steps_on_multi30k_train_and_validate(project_root, tmp_path):
    cfg = config(
        project_root, tmp_path, "model.preset=tiny", "model.N=1", "tokenizer.vocab_size=1000",
        "tokenizer.sample_sentences=4000", "train.max_steps=4", "train.eval_batches=2",
        "train.max_tokens=1500", "logging.every_steps=2",
    )  # fmt: skip
    result = train(cfg)
    assert 0 < result["loss"] < 8.0  # ln(1000) = 6.9 is a uniform guess
