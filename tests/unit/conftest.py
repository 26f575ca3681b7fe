"""Corpora and a tokenizer for the data tests (test_data.py, test_cache.py), one per module."""

from pathlib import Path

import pytest

from aiayn.config import TokenizerConfig
from aiayn.corpora.demo import write_lm, write_numbers
from aiayn.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_numbers(tmp_path_factory.mktemp("numbers"), n_train=300, n_valid=60, n_test=10)


@pytest.fixture(scope="module")
def lm_corpus(tmp_path_factory) -> Path:
    return write_lm(tmp_path_factory.mktemp("lm"), n_train=80, n_valid=10, n_test=10)


@pytest.fixture(scope="module")
def tok(corpus, lm_corpus, tmp_path_factory):
    sents = [
        line
        for path in (corpus / "train.en", corpus / "train.de", lm_corpus / "train.txt")
        for line in path.read_text().splitlines()
    ]
    out = tmp_path_factory.mktemp("tok") / "spm.model"
    return train_tokenizer(TokenizerConfig(vocab_size=150), sents, out)
