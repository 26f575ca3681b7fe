"""WikiText-2 from ../shared/data/wikitext-2 (skipped where it is absent): the recipe's config
scores word-level perplexity over the word counts published figures divide by."""

from pathlib import Path

import pytest

from aiayn.config import load_config
from aiayn.eval.lm_scores import count_units
from aiayn.eval.scores import split_lines

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"

pytestmark = pytest.mark.skipif(
    not (DATA / "wiki.test.tokens.gz").is_file(), reason=f"WikiText-2 is not in {DATA}"
)


@pytest.mark.parametrize("split, words", [("valid", 217_646), ("test", 245_569)])
def test_the_config_counts_the_published_words_with_one_eos_per_line(split, words):
    cfg = load_config(ROOT / "configs" / "wikitext2_lm.yaml")
    assert cfg.data.unit == "words"
    # The config's paths are relative to the project root, as the recipe runs them.
    spec = str(ROOT / getattr(cfg.data, split))
    assert count_units(split_lines(cfg, spec), "words") == words
