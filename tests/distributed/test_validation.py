"""The whole dev set translated at a validation, shared among ranks (evaluate.Validation), with
real processes: two ranks give one process's hypotheses line for line, each translating about
half, and every rank gets the same scores."""

import json
import sys
from pathlib import Path

import pytest

from procs import run, torchrun

pytestmark = pytest.mark.distributed
WORKER = str(Path(__file__).with_name("validate_dev.py"))
DEV = 100  # the numbers corpus's validation pairs (procs.make_setup)


def validate(setup, launcher: list[str], name: str, *overrides: str) -> tuple[Path, list[dict]]:
    root, config = setup
    run_dir, out = root / f"valid_{name}", root / f"valid_{name}_out"
    out.mkdir()
    run(launcher + [WORKER, str(config), str(run_dir), str(out), *overrides])
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
    return run_dir, ranks


def test_two_ranks_translate_half_each_and_give_one_process_hypotheses(setup):
    one_dir, (one,) = validate(setup, [sys.executable], "one", "decode.batch_size=8")
    two_dir, two = validate(setup, torchrun(2), "two", "decode.batch_size=8")
    hyps = (one_dir / "valid" / "step_00000001.hyp").read_text().splitlines()
    assert len(hyps) == DEV and len(set(hyps)) > 1  # one line per dev sentence
    assert (two_dir / "valid" / "step_00000001.hyp").read_text().splitlines() == hyps
    assert one["translated"] == list(range(DEV))
    shares = [r["translated"] for r in two]
    assert sorted(shares[0] + shares[1]) == list(range(DEV))
    assert all(0.35 < len(share) / DEV < 0.65 for share in shares), [len(s) for s in shares]
    keys = ("bleu", "bleu_lc", "chrf", "ter", "loss")
    assert all(
        r["result"][k] == pytest.approx(one["result"][k], rel=1e-9) for r in two for k in keys
    )
    assert two[0]["result"]["ter"] == two[1]["result"]["ter"]  # every rank has rank 0's scores
