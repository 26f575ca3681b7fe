"""The SentencePiece tokenizer: deterministic training, fixed special ids, round trips, the
contract, and errors that say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.config import TokenizerConfig
from aiayn.corpora.demo import english_number, german_number
from aiayn.errors import TokenizerError
from aiayn.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    check_contract,
    train_tokenizer,
)

SENTENCES = [f(n) for n in range(0, 3000, 7) for f in (english_number, german_number)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    cfg = TokenizerConfig(vocab_size=120, user_symbols=["<2de>"])
    return train_tokenizer(cfg, SENTENCES, tmp_path_factory.mktemp("tok") / "spm.model")


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_training_twice_on_the_same_sentences_gives_the_same_bytes(kind, tmp_path):
    cfg = TokenizerConfig(type=kind, vocab_size=100)
    a = train_tokenizer(cfg, SENTENCES, tmp_path / "a" / "spm.model")
    b = train_tokenizer(cfg, iter(SENTENCES), tmp_path / "b" / "spm.model")
    assert a.path.read_bytes() == b.path.read_bytes()
    assert a.contract() == b.contract() and a.type == kind
    c = train_tokenizer(cfg, SENTENCES[::-1][:300], tmp_path / "c" / "spm.model")
    assert c.contract()["sha256"] != a.contract()["sha256"]


def test_special_ids_are_fixed_and_named(tok):
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert [tok.sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == 120


def test_training_writes_model_vocab_and_contract_and_no_temporary_files(tok):
    files = sorted(p.name for p in tok.path.parent.iterdir())
    assert files == ["spm.json", "spm.model", "spm.vocab"]
    assert len(tok.path.with_suffix(".vocab").read_text().splitlines()) == 120


def test_encode_then_decode_gives_the_text_back(tok):
    texts = ["three hundred twenty-one", "dreihunderteinundzwanzig", "<2de> one"]
    ids = tok.encode(texts)
    assert all(BOS_ID not in row and EOS_ID not in row for row in ids)
    assert tok.decode(ids) == texts
    assert tok.sp.piece_to_id("<2de>") in ids[2]  # a user symbol is never split


def test_decode_stops_at_eos_and_drops_pad_and_bos(tok):
    ids = tok.encode(["seven"])[0]
    assert tok.decode([[BOS_ID, *ids, EOS_ID, *ids, PAD_ID], [*ids, PAD_ID, PAD_ID]]) == [
        "seven",
        "seven",
    ]


def test_contract_mismatch_lists_every_differing_field(tok):
    recorded = {**tok.contract(), "sha256": "0" * 64, "vocab_size": 8000}
    with pytest.raises(TokenizerError) as err:
        check_contract(recorded, tok, "checkpoint step_100")
    msg = str(err.value)
    assert f"sha256: recorded '{'0' * 64}', found '{tok.sha256}'" in msg
    assert "vocab_size: recorded 8000, found 120" in msg
    assert "pad_id" not in msg and "checkpoint step_100" in msg
    assert "Use the tokenizer the run was trained with" in msg
    check_contract(tok.contract(), tok, "checkpoint step_100")  # the same one passes


def test_too_large_vocab_says_the_largest_that_fits(tmp_path):
    with pytest.raises(TokenizerError) as err:
        train_tokenizer(TokenizerConfig(vocab_size=5000), SENTENCES[:50], tmp_path / "spm.model")
    msg = str(err.value)
    assert "tokenizer.vocab_size 5000 is too large for the 50 training sentences" in msg
    limit = int(msg.split("Set tokenizer.vocab_size <= ")[1].split(",")[0])
    assert 8 < limit < 5000
    train_tokenizer(TokenizerConfig(vocab_size=limit), SENTENCES[:50], tmp_path / "spm.model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.json", "spm.model", "spm.vocab"]


def test_too_small_vocab_and_empty_input_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="raise tokenizer.vocab_size"):
        train_tokenizer(TokenizerConfig(vocab_size=8), SENTENCES, tmp_path / "spm.model")
    with pytest.raises(TokenizerError, match="no sentences to train the tokenizer on"):
        train_tokenizer(TokenizerConfig(), ["", "  "], tmp_path / "spm.model")
    assert not (tmp_path / "spm.model").exists()


def test_missing_model_says_how_to_make_one(tmp_path):
    with pytest.raises(TokenizerError) as err:
        Tokenizer(tmp_path / "nope.model")
    assert "aiayn tokenizer train --config FILE" in str(err.value)
    assert "tokenizer.path" in str(err.value) and "nope.model" in str(err.value)


def test_a_file_that_is_not_a_model_is_refused(tmp_path):
    bad = Path(tmp_path / "bad.model")
    bad.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="is not a SentencePiece model"):
        Tokenizer(bad)


def test_default_options_pass_nothing_new_to_sentencepiece():
    """An option passed at its default value still changes the model's bytes: tokenizers
    trained before normalization / char / <unk> existed must keep their sha256."""
    from aiayn.tokenizer.spm import _non_default_options

    assert _non_default_options(TokenizerConfig()) == {}
    char = TokenizerConfig(type="char", normalization="identity", remove_extra_whitespaces=False)
    assert _non_default_options(char) == {
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "hard_vocab_limit": False,
        "add_dummy_prefix": False,
    }
