"""The paper's BLEU (aiayn/eval/paper_bleu.py): Moses-tokenized, compound-split, case-sensitive
BLEU, checked against a case worked by hand and the splitting rule against Perl's one-liner;
`aiayn score` reads any hypotheses and references files."""

import json
import math
import shutil
import subprocess

import pytest

from aiayn.cli import main
from aiayn.eval.paper_bleu import compound_split_bleu, moses_tokenize, split_compounds
from aiayn.eval.scores import translation_scores

HYPS = ["Die Ski-Weltmeisterin gewann.", "Das E-Mail-Konto ist neu."]
REFS = ["Die Ski-Weltmeisterin siegte gestern.", "Das E-Mail-Konto ist alt."]


def test_compound_split_bleu_of_a_case_worked_by_hand():
    # Moses splits the final full stops off; every hyphen between two non-blanks becomes the
    # token @ = ##AT##-##AT## (W = Weltmeisterin):
    #   hyp 1  Die Ski @ W gewann .                 6 tokens
    #   ref 1  Die Ski @ W siegte gestern .         7
    #   hyp 2  Das E @ Mail @ Konto ist neu .       9
    #   ref 2  Das E @ Mail @ Konto ist alt .       9
    # Matches (ref 2 holds @ twice, so both of hyp 2's count):
    #   1-grams  hyp 1: all but "gewann" 5/6;  hyp 2: all but "neu" 8/9         13/15
    #   2-grams  Die Ski, Ski @, @ W 3/5;  Das E .. Konto ist 6/8               9/13
    #   3-grams  Die Ski @, Ski @ W 2/4;  Das E @ .. @ Konto ist 5/7            7/11
    #   4-grams  Die Ski @ W 1/3;  Das E @ Mail .. Mail @ Konto ist 4/6        5/9
    # Product of the precisions 13/15 * 9/13 * 7/11 * 5/9 = 7/33; hypothesis 15 tokens,
    # reference 16: brevity penalty exp(1 - 16/15).
    expected = 100 * math.exp(1 - 16 / 15) * (7 / 33) ** 0.25  # 63.488...
    got = compound_split_bleu(HYPS, REFS)
    assert got["bleu_compound_split"] == pytest.approx(expected, rel=1e-12)
    assert got["bleu_compound_split_signature"] == (
        "moses-de+##AT##-##AT##|nrefs:1|case:mixed|eff:no|tok:none|smooth:none|version:"
        + got["bleu_compound_split_signature"].rsplit(":", 1)[1]
    )
    # sacreBLEU on the detokenized text keeps each compound one token: 29.05 here.
    assert translation_scores(HYPS, REFS)["bleu"] == pytest.approx(29.05, abs=0.01)


def test_no_match_of_an_order_gives_zero_as_multi_bleu_does():
    # One 3-token sentence: no 4-gram at all, so no smoothing and BLEU 0 (multi-bleu.perl's).
    assert compound_split_bleu(["Guten Tag ."], ["Guten Tag ."])["bleu_compound_split"] == 0.0
    same = compound_split_bleu(["Das ist gut ."], ["Das ist gut ."])
    assert same["bleu_compound_split"] == pytest.approx(100)


LINES = [
    "rich-text format",  # GNMT's example
    "a-b-c",  # matches do not overlap: the b is used, the second hyphen stays
    "Ende - Anfang",  # a dash between blanks is not a compound
    "-5 und x- y",
    "über-all und 3-4",  # any non-blank, numbers and non-ASCII letters alike
    "x--y",
    "a\u00a0-b",  # a no-break space is a non-blank to Perl's byte regex
]


def test_the_splitting_rule():
    assert [split_compounds(line) for line in LINES] == [
        "rich ##AT##-##AT## text format",
        "a ##AT##-##AT## b-c",
        "Ende - Anfang",
        "-5 und x- y",
        "über ##AT##-##AT## all und 3 ##AT##-##AT## 4",
        "x ##AT##-##AT## -y",
        "a\u00a0 ##AT##-##AT## b",
    ]


@pytest.mark.skipif(shutil.which("perl") is None, reason="no perl to compare with")
def test_the_splitting_rule_is_the_perl_one_liners():
    perl = subprocess.run(
        ["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"],
        input="\n".join(LINES) + "\n",
        capture_output=True,
        text=True,
        encoding="utf-8",
        check=True,
    )
    assert perl.stdout.splitlines() == [split_compounds(line) for line in LINES]


def test_moses_tokenization_keeps_compounds_whole_and_escapes():
    assert moses_tokenize(['Er sagt: "E-Mail-Konto" & mehr.'], "de") == [
        "Er sagt : &quot; E-Mail-Konto &quot; &amp; mehr ."
    ]


def test_aiayn_score_scores_any_hypotheses_and_references_files(tmp_path, capsys):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("".join(h + "\n" for h in HYPS), encoding="utf-8")
    ref.write_text("".join(r + "\n" for r in REFS), encoding="utf-8")
    assert main(["score", "--hyp", str(hyp), "--ref", str(ref), "--compound-split", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bleu_compound_split"] == pytest.approx(63.4882, abs=1e-4)
    assert got["bleu"] == pytest.approx(29.05, abs=0.01) and got["lines"] == 2
    assert "tok:13a" in got["bleu_signature"]

    ref.write_text(REFS[0] + "\n", encoding="utf-8")  # one line short
    assert main(["score", "--hyp", str(hyp), "--ref", str(ref)]) == 2
    assert "has 2 lines and" in capsys.readouterr().err
