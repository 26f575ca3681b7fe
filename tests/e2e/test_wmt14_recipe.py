"""launch/wmt14.py, the paper's WMT 2014 en->de recipe, through every stage to its table, on
configs/wmt14_en_de_base.yaml as it is but for its size: the Hub dataset is a local folder in
wmt/wmt14's layout holding the numbers corpus (English words -> German words), the model tiny,
ten steps. What is checked is the plumbing (tokenizer, data prepare, train, the paper's average,
both scores, the table), not the score, which takes GPU-hours (docs/recipes.md#wmt14)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from aiayn.checkpoint import read_manifest
from aiayn.eval.paper_bleu import compound_split_bleu

from helpers import TINY_MODEL, hub_dataset, model_overrides  # tests/helpers.py

STAGES = ["tokenizer", "prepare", "train", "finish", "score", "total"]
ROWS = re.compile(
    r"^\| (average of last 5, beam|last checkpoint, beam) \| ([\d.]+) \| ([\d.]+) \|", re.M
)


def tiny_config(project_root, path):
    """The base config with the batch a tiny model takes, fixed over all ranks as the config
    fixes it (train.tokens_per_step): 1,600 tokens a step, 8 units of 200 (train.unit_tokens, as
    the config plans), fused into forwards of up to 800."""
    cfg = yaml.safe_load((Path(project_root) / "configs" / "wmt14_en_de_base.yaml").read_text())
    assert "grad_accum" not in cfg["train"]
    assert cfg["train"]["unit_tokens"] * 64 == cfg["train"]["tokens_per_step"]
    cfg["train"].update(tokens_per_step=1600, unit_tokens=200, max_tokens=800)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_the_wmt14_recipe_prepares_trains_averages_scores_both_ways_and_prints_its_table(
    project_root, tmp_path, numbers
):
    run_dir = tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}",
        f"data.hub_name={hub_dataset(tmp_path / 'wmt14', numbers)}",  # de-en, as wmt/wmt14
        f"tokenizer.path={tmp_path}/bpe.model",
        "tokenizer.vocab_size=100",
        "data.max_len=40",
        "data.shuffle_buffer=500",
        *model_overrides(TINY_MODEL),
        "schedule.warmup=10",
        "train.max_steps=10",
        "train.eval_every=10",
        "train.eval_bleu=0",
        "train.precision=fp32",
        "train.threads=1",
        "checkpoint.every_steps=2",  # the config's train.finish and keep_last: 5
        "decode.max_len_b=10",  # an untrained model's hypotheses end soon
    ]
    config = tiny_config(project_root, tmp_path / "wmt14_tiny.yaml")
    cmd = [sys.executable, "launch/wmt14.py", "--config", str(config), *overrides]
    out = subprocess.run(cmd, cwd=project_root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    # data prepare built the token cache as a stage of its own; train only opened it.
    assert "+ aiayn data prepare" in out.stdout and '"examples": 2000' in out.stdout
    # The tokenizer stage copied the Hub split once; prepare built the cache from that copy.
    (copy,) = (run_dir / "data_cache" / "hub").glob("*/de-en/train/manifest.json")
    assert json.loads(copy.read_text())["rows"] == 2000
    log = (run_dir / "train.log").read_text()
    assert "built in" not in log
    assert (
        "1,600 tokens a step over all ranks = 200-token units x 8 shared by 1 ranks (8 each), "
        "fused into forwards of up to 800 tokens"
    ) in log
    # aiayn finish averaged the paper's last 5 checkpoints (the config's train.finish).
    averaged = read_manifest(run_dir / "averaged")["averaged_from"]
    assert [s["step"] for s in averaged] == [2, 4, 6, 8, 10]

    stages = re.findall(r"^\| (\w+) \| [\d.]+ (?:s|min|h) \|$", out.stdout, re.M)
    assert stages == STAGES
    rows = ROWS.findall(out.stdout)
    assert [name for name, *_ in rows] == ["average of last 5, beam", "last checkpoint, beam"]
    assert all(0 <= float(v) <= 100 for _, paper, sacre in rows for v in (paper, sacre))
    assert "newstest2014: 50 sentences" in out.stdout
    assert "The paper (Table 2): its base model 27.3" in out.stdout
    assert "moses-de+##AT##-##AT##|nrefs:1|case:mixed|eff:no|tok:none|smooth:none" in out.stdout
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp" in out.stdout

    # The table's paper figure is that of the averaged model's newstest2014 files.
    hyps = (run_dir / "eval" / "test.averaged.hyp").read_text(encoding="utf-8").splitlines()
    refs = (run_dir / "eval" / "test.averaged.ref").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs) == 50
    assert refs == (numbers / "test.de").read_text(encoding="utf-8").splitlines()
    assert rows[0][1] == f"{compound_split_bleu(hyps, refs)['bleu_compound_split']:.2f}"


def test_the_slurm_cpu_step_trains_the_tokenizer_and_builds_the_token_cache(
    project_root, tmp_path, numbers
):
    """slurm/prepare.sbatch, run by bash as Slurm would run it (docs/slurm.md): what the GPU
    job then only opens."""
    run_dir = tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}",
        f"data.train={numbers}/train",
        f"tokenizer.path={tmp_path}/spm.model",
        "tokenizer.vocab_size=100",
    ]
    out = subprocess.run(
        ["bash", "slurm/prepare.sbatch", "configs/demo.yaml", *overrides],
        cwd=project_root,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "+ " + sys.executable + " -m aiayn data prepare --config configs/demo.yaml" in out.stdout
    assert (tmp_path / "spm.model").is_file()
    assert '"examples": 2000' in out.stdout
    assert (run_dir / "data_cache" / "train" / "manifest.json").is_file()
