"""The run's copy of its validation split (aiayn/data/split_copies.py): the same records as the
source in every format, made once, kept when the source changes or goes."""

import dataclasses
import itertools
import json
import logging
from pathlib import Path

import pytest
from batch_checks import same, stream_loader

from aiayn.config import Config, DataConfig, ModelConfig
from aiayn.data import open_split
from aiayn.data.split_copies import copied_split, with_run_copy
from aiayn.errors import DataError


def config(run_dir: Path, kind: str, **data) -> Config:
    return dataclasses.replace(
        Config(), run_dir=str(run_dir), model=ModelConfig(kind=kind), data=DataConfig(**data)
    )


def write_classify(path: Path) -> Path:
    rows = [{"text": f"review number {i}", "label": i % 3} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("kind", ["seq2seq", "lm", "classifier"])
def test_the_copy_reads_as_the_source_did(kind, corpus, lm_corpus, tok, tmp_path):
    data = {
        "seq2seq": dict(format="parallel", valid=str(corpus / "valid"), src_lang="en",
                        tgt_lang="de"),
        "lm": dict(format="text", valid=str(lm_corpus / "valid.txt")),
        "classifier": dict(format="jsonl", valid=str(write_classify(tmp_path / "c.jsonl"))),
    }[kind]  # fmt: skip
    cfg = config(tmp_path / "run", kind, **data)
    local = with_run_copy(cfg, "valid")
    assert local.data.valid == str(tmp_path / "run" / "data" / "valid.jsonl")
    source = list(open_split(cfg.data, cfg.data.valid, kind))
    assert list(open_split(local.data, local.data.valid, kind)) == source
    if kind == "seq2seq":  # and the validation batches are the same

        def batches(c):
            ld = stream_loader(c.data, c.data.valid, tok, kind=kind, max_tokens=200, seed=1,
                               train=False)  # fmt: skip
            return list(itertools.islice(ld, 100))

        assert all(same(a, b) for a, b in zip(batches(cfg), batches(local), strict=True))


def test_the_copy_is_made_once_and_kept_when_the_source_changes(corpus, tmp_path, caplog):
    source = tmp_path / "corpus"
    for suffix in ("en", "de"):
        (source.parent / "corpus").mkdir(exist_ok=True)
        (source / f"valid.{suffix}").write_bytes((corpus / f"valid.{suffix}").read_bytes())
    data = dict(format="parallel", valid=str(source / "valid"), src_lang="en", tgt_lang="de")
    cfg = config(tmp_path / "run", "seq2seq", **data)
    local = with_run_copy(cfg, "valid")
    copied = Path(local.data.valid).read_bytes()
    for suffix, line in (("en", b"one more\n"), ("de", b"noch eins\n")):
        with (source / f"valid.{suffix}").open("ab") as fh:
            fh.write(line)
    with caplog.at_level(logging.WARNING):
        with_run_copy(cfg, "valid")
    assert "differs from the copy the run made at its first start" in caplog.text
    assert Path(local.data.valid).read_bytes() == copied
    for suffix in ("en", "de"):
        (source / f"valid.{suffix}").unlink()  # gone: the copy is all a restart needs
    assert Path(with_run_copy(cfg, "valid").data.valid).read_bytes() == copied


def test_a_missing_source_at_the_first_start_names_the_split(tmp_path):
    data = dict(format="parallel", valid=str(tmp_path / "nowhere"), src_lang="en", tgt_lang="de")
    with pytest.raises(DataError, match="copying data.valid into the run: corpus file not found"):
        with_run_copy(config(tmp_path / "run", "seq2seq", **data), "valid")


def test_evaluating_reads_the_runs_copy_of_the_split_it_names_and_makes_none(corpus, tmp_path):
    data = dict(format="parallel", test=str(corpus / "valid"), src_lang="en", tgt_lang="de")
    cfg = config(tmp_path / "run", "seq2seq", **data)
    assert copied_split(cfg, "test", tmp_path / "run") is None  # no copy: the source
    assert not (tmp_path / "run").exists()  # and none was made
    with_run_copy(cfg, "test")  # what a training run's first start does
    local = copied_split(cfg, "test", tmp_path / "run")
    assert local.data.test == str(tmp_path / "run" / "data" / "test.jsonl")
    source = list(open_split(cfg.data, cfg.data.test, "seq2seq"))
    assert list(open_split(local.data, local.data.test, "seq2seq")) == source
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, test=str(corpus / "test")))
    assert copied_split(other, "test", tmp_path / "run") is None  # an override names another
