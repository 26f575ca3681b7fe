"""Scoring a language model on a whole text (eval/lm_scores.py), checked against sums by hand."""

import math

import numpy as np
import pytest
import torch

from aiayn.config import ModelConfig, TokenizerConfig
from aiayn.data.plan import lm_plan
from aiayn.eval.lm_scores import count_units, lm_scores, text_stream, windows
from aiayn.infer.generate import sample_text
from aiayn.model import build_model
from aiayn.tokenizer import train_tokenizer

LINES = ["First Citizen:", "Before we proceed any further, hear me speak.", "", "All:", "Speak."]


@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
    cfg = TokenizerConfig(
        type="char", vocab_size=100, normalization="identity", remove_extra_whitespaces=False
    )
    return train_tokenizer(cfg, LINES * 3, tmp_path_factory.mktemp("tok") / "spm.model")


@pytest.fixture(scope="module")
def model(char_tok):
    torch.manual_seed(0)
    cfg = ModelConfig(kind="lm", N=1, d_model=32, d_ff=64, h=4, max_len=64, dropout=0.0)
    return build_model(cfg, char_tok.vocab_size, char_tok.pad_id).eval()


def test_a_char_tokenizer_with_identity_normalisation_gives_back_the_exact_text(char_tok):
    lines = ["  two  spaces ", "a", "", "All:"]
    assert char_tok.decode(char_tok.encode(lines)) == lines
    assert [len(ids) for ids in char_tok.encode(lines)] == [len(line) for line in lines]


@pytest.mark.parametrize("n, window, stride", [(50, 8, None), (50, 8, 3), (7, 8, 2), (9, 4, 1)])
def test_windows_score_every_target_once_with_the_promised_context(n, window, stride):
    seen = []
    for begin, end, first in windows(n, window, stride):
        assert end - begin <= window and begin < first <= end + 1
        seen += range(first, end + 1)
        if first > 1 and stride is not None:  # every scored target has window - stride behind it
            assert first - 1 - begin >= window - stride
    assert seen == list(range(1, n + 1))


def nll_by_hand(model, stream, spans):
    """Sum of -log p(target) over the scored targets of each window, one window at a time."""
    total = 0.0
    with torch.no_grad():
        for begin, end, first in spans:
            logp = model(stream[None, begin:end]).log_softmax(-1)[0]  # (end - begin, V)
            for t in range(first, end + 1):  # target t is predicted at column t - 1 - begin
                total -= logp[t - 1 - begin, stream[t]].item()
    return total


@pytest.mark.parametrize("stride", [None, 5])
def test_scores_equal_the_sum_done_by_hand(model, char_tok, stride):
    stream = text_stream(char_tok, LINES)
    assert len(stream) == 1 + sum(len(line) + 1 for line in LINES)  # eos, then line + break
    window = 16
    # By hand, without windows(): non-overlapping blocks, or windows advancing by the stride
    # that score what the previous one did not.
    n, spans, begin, done = len(stream) - 1, [], 0, 0
    while done < n:
        end = min(begin + window, n)
        spans.append((begin, end, done + 1))
        done, begin = end, begin + (stride or window)
    expect = nll_by_hand(model, stream, spans)

    got = lm_scores(
        model, char_tok, LINES, window=window, stride=stride, unit="characters",
        device=torch.device("cpu"), rows=3,
    )  # fmt: skip
    chars = sum(len(line) + 1 for line in LINES)
    assert got["characters"] == chars == got["tokens"]
    assert got["loss"] == pytest.approx(expect / chars, rel=1e-5)
    assert got["bpc"] == pytest.approx(expect / (chars * math.log(2)), rel=1e-5)
    words = lm_scores(
        model, char_tok, LINES, window=window, stride=stride, unit="words",
        device=torch.device("cpu"),
    )  # fmt: skip
    assert words["words"] == 12 + 5  # whitespace-separated words, plus one per line
    assert words["word_ppl"] == pytest.approx(math.exp(expect / 17), rel=1e-4)


def test_a_context_longer_than_a_window_scores_lower_on_a_repeating_text(model, char_tok):
    """The sliding window gives tokens more context: on a text that repeats, a trained model
    would do better; here the check is that the two scorings differ and both count all."""
    a = lm_scores(model, char_tok, LINES, window=8, stride=None, unit="tokens",
                  device=torch.device("cpu"))  # fmt: skip
    b = lm_scores(model, char_tok, LINES, window=8, stride=2, unit="tokens",
                  device=torch.device("cpu"))  # fmt: skip
    assert a["tokens"] == b["tokens"] and a["loss"] != b["loss"]


def test_ranks_score_disjoint_windows_that_sum_to_the_whole(model, char_tok):
    whole = lm_scores(model, char_tok, LINES, window=8, stride=4, unit="characters",
                      device=torch.device("cpu"))  # fmt: skip
    parts = [
        lm_scores(
            model,
            char_tok,
            LINES,
            window=8,
            stride=4,
            unit="characters",
            device=torch.device("cpu"),
            rank=r,
            world_size=2,
        )  # fmt: skip
        for r in (0, 1)
    ]
    assert sum(p["tokens"] for p in parts) == whole["tokens"]
    nll = sum(p["loss"] * p["tokens"] for p in parts)
    assert nll == pytest.approx(whole["loss"] * whole["tokens"], rel=1e-5)


def test_units_count_characters_with_breaks_and_words_with_one_per_line():
    assert count_units(["ab c", ""], "characters") == 5 + 1
    assert count_units([" = Title = ", "", "a b"], "words") == 3 + 1 + 0 + 1 + 2 + 1


def test_running_text_samples_run_to_the_limit_and_turn_eos_into_line_breaks(model, char_tok):
    texts = sample_text(
        model, char_tok, ["All:\nSp", ""], max_new_tokens=100, seed=3, running_text=True
    )
    assert texts[0].startswith("All:\nSp")
    # eos is a line break, not an end: every sample has its 100 new tokens, past the model's
    # 64 positions
    for text in texts:
        new = char_tok.encode(text.split("\n"))
        assert sum(map(len, new)) + text.count("\n") >= 100
    again = sample_text(
        model, char_tok, ["All:\nSp", ""], max_new_tokens=100, seed=3, running_text=True
    )
    assert again == texts


def test_stream_plan_covers_the_text_once_from_a_moving_offset_in_shuffled_blocks():
    lengths = np.array([5, 0, 7, 3, 0, 9])  # empty lines stay: each is a line break
    total = int((lengths + 1).sum())
    offsets = set()
    for epoch in range(6):
        rng = np.random.default_rng([1, epoch])
        plan = lm_plan(lengths, 4, 2, rng, order="stream")
        assert list(plan.docs) == list(range(6)) and plan.total in (total, total - 1)
        blocks = np.concatenate([plan.blocks(k) for k in range(len(plan))])
        assert sorted(blocks) == list(range(plan.n_blocks))
        starts = plan.offset + blocks * plan.size
        covered = sorted(p for s in starts for p in range(s, min(s + plan.size, plan.total)))
        assert covered == list(range(plan.offset, plan.total))
        offsets.add(plan.offset)
    assert len(offsets) > 1  # block boundaries move from epoch to epoch
    fixed = lm_plan(lengths, 4, 2, None, order="stream")  # validation: in order, from 0
    assert fixed.offset == 0 and list(fixed.blocks(0)) == [0, 1]


def test_documents_plan_drops_empty_documents_and_permutes_the_rest():
    lengths = np.array([5, 0, 7, 3, 0, 9])
    plan = lm_plan(lengths, 4, 2, np.random.default_rng(0), order="documents")
    assert sorted(plan.docs) == [0, 2, 3, 5] and plan.offset == 0 and plan.order is None
    assert plan.total == 5 + 7 + 3 + 9 + 4
