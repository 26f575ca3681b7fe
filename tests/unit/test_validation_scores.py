"""The dev set's translation, shared among ranks, and its scores: the batches each rank decodes
are the ones one process decodes, dealt out by cost; BLEU, chrF and TER equal sacreBLEU's
command line on the same files, and each metric ranks in its own direction."""

import json
import random
import subprocess
import sys

import pytest

from aiayn.config import config_from_dict
from aiayn.eval.scores import translation_scores
from aiayn.infer.translate import length_batches, rank_shares

HYPS = [
    "a man rides a red bicycle down the street .",
    "two dogs are playing in the snow",
    "a woman is reading a book on a bench .",
    "children play football on the grass .",
]
REFS = [
    "A man is riding a red bike down the street .",
    "Two dogs play in the snow .",
    "A woman reads a book on a park bench .",
    "Some children are playing soccer on the grass .",
]


def test_scores_equal_the_sacrebleu_command_line(tmp_path):
    (tmp_path / "hyp").write_text("".join(h + "\n" for h in HYPS))
    (tmp_path / "ref").write_text("".join(r + "\n" for r in REFS))
    cli = [sys.executable, "-m", "sacrebleu", str(tmp_path / "ref"), "-i", str(tmp_path / "hyp")]
    figures = subprocess.run(
        cli + ["-m", "bleu", "chrf", "ter", "-b", "-w", "4"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lowercased = subprocess.run(
        cli + ["-m", "bleu", "-lc", "-b", "-w", "4"], capture_output=True, text=True, check=True
    ).stdout
    got = translation_scores(HYPS, REFS)
    # With several metrics the command line prints a JSON list of the scores.
    assert [round(got[k], 4) for k in ("bleu", "chrf", "ter")] == json.loads(figures)
    assert round(got["bleu_lc"], 4) == float(lowercased)
    assert 0 < got["bleu"] < 100 and 0 < got["ter"] < 100  # figures that can disagree
    assert got["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no")
    assert got["ter_signature"].startswith("nrefs:1|case:lc|tok:tercom")


def test_each_metric_ranks_in_its_own_direction():
    """A perfect translation scores best on every metric; lower TER is better (OpenNMT-py's
    early stopping had it inverted), as checkpoint.best_mode auto knows."""
    perfect, worse = translation_scores(REFS, REFS), translation_scores(HYPS, REFS)
    assert perfect["bleu"] > worse["bleu"] and perfect["chrf"] > worse["chrf"]
    assert perfect["ter"] == 0 < worse["ter"]
    higher = {
        metric: config_from_dict(
            {"data": {"train": "x"}, "checkpoint": {"best_metric": f"valid/{metric}"}}
        ).checkpoint.higher_is_better
        for metric in ("bleu", "bleu_lc", "chrf", "ter", "loss")
    }
    assert higher == {"bleu": True, "bleu_lc": True, "chrf": True, "ter": False, "loss": False}


@pytest.mark.parametrize("world", [1, 2, 3, 8, 40])
def test_every_batch_goes_to_one_rank_and_the_loads_balance(world):
    rng = random.Random(world)
    encoded = [[0] * rng.randrange(1, 60) for _ in range(301)]
    batches = length_batches(encoded, 16)
    assert sorted(i for b in batches for i in b) == list(range(301))
    assert all(len(b) == 16 for b in batches[:-1])  # one process's batches, by length
    shares = rank_shares(batches, encoded, world)
    assert sorted(j for share in shares for j in share) == list(range(len(batches)))
    cost = [len(b) * (1 + max(len(encoded[i]) for i in b)) for b in batches]
    loads = [sum(cost[j] for j in share) for share in shares]
    if world <= len(batches):
        assert max(loads) - min(loads) <= max(cost)  # greedy, costliest first
    assert shares == rank_shares(batches, encoded, world)  # the same on every rank
