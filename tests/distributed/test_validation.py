"""The whole dev set translated at a validation, shared among ranks (evaluate.Validation), with
real processes: two ranks, under DDP and under ZeRO-3 (its partitioned model, in lockstep),
give one process's hypotheses line for line, each translating about half, and every rank gets
the same scores."""

import json
import sys
from pathlib import Path

import pytest

from helpers import torchrun  # tests/helpers.py
from procs import one_launch, run

pytestmark = pytest.mark.distributed
WORKER = str(Path(__file__).with_name("validate_dev.py"))
DEV = 100  # the numbers corpus's validation pairs (procs.make_setup)
RELEASE = Path(__file__).with_name("zero3_release.json")


ENGINES = {
    "ddp": (),
    # Partitioned: every layer's forward is a collective, so the ranks decode in step
    # (evaluate.Lockstep), with no gathered copy of the model. DeepSpeed is told to release
    # each layer after its forward (it keeps up to 1e9 parameters gathered by default).
    "zero3": (
        "distributed.backend=deepspeed",
        "distributed.zero_stage=3",
        f"distributed.deepspeed_config={RELEASE}",
    ),
}


def validate(setup, launcher: list[str], runs: dict[str, tuple[str, ...]]) -> dict[str, tuple]:
    """Each named validation (its overrides) in one launch: name -> (run_dir, each rank's
    report)."""
    root, config = setup
    dirs = {name: (root / f"valid_{name}", root / f"valid_{name}_out") for name in runs}
    for _, out in dirs.values():
        out.mkdir()
    args = [[*map(str, dirs[name]), "decode.batch_size=8", *runs[name]] for name in runs]
    run(launcher + [WORKER, str(config), *one_launch(args)])
    return {
        name: (run_dir, [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))])
        for name, (run_dir, out) in dirs.items()
    }


@pytest.fixture(scope="module")
def one(setup):
    """One process's validation: (its hypotheses, its rank's report)."""
    run_dir, (report,) = validate(setup, [sys.executable], {"one": ()})["one"]
    hyps = (run_dir / "valid" / "step_00000001.hyp").read_text().splitlines()
    assert len(hyps) == DEV and len(set(hyps)) > 1  # one line per dev sentence
    assert report["translated"] == list(range(DEV))
    return hyps, report


@pytest.fixture(scope="module")
def two_ranks(setup):
    """Two ranks' validations under each engine, one after the other in one launch."""
    return validate(setup, torchrun(2), {f"two_{name}": opts for name, opts in ENGINES.items()})


@pytest.mark.parametrize("engine", ENGINES)
def test_two_ranks_translate_half_each_and_give_one_process_hypotheses(one, two_ranks, engine):
    hyps, single = one
    run_dir, two = two_ranks[f"two_{engine}"]
    assert (run_dir / "valid" / "step_00000001.hyp").read_text().splitlines() == hyps
    assert all(r["partitioned"] == (engine == "zero3") for r in two)
    shares = [r["translated"] for r in two]
    assert sorted(shares[0] + shares[1]) == list(range(DEV))
    assert all(0.35 < len(share) / DEV < 0.65 for share in shares), [len(s) for s in shares]
    keys = ("bleu", "bleu_lc", "chrf", "ter", "loss", "accuracy")
    assert all(
        r["result"][k] == pytest.approx(single["result"][k], rel=1e-6) for r in two for k in keys
    )
    assert two[0]["result"]["ter"] == two[1]["result"]["ter"]  # every rank has rank 0's scores
    if engine == "zero3":
        # never the whole model on a rank: a layer's weights at a time (a gathered copy, as
        # validation made before, holds all of it)
        most = [r["most_gathered"] for r in two]
        assert None not in most and max(most) < 0.5, most
