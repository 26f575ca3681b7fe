"""Streaming sources and the loader over them: content, budget, shuffling, ranks, exact resume, and
the errors a bad corpus gives."""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from batch_checks import check_pair_rows, lines, roundtrip, same, stream_loader, take

from aiayn.config import DataConfig
from aiayn.corpora.demo import write_classify
from aiayn.data import Batch, Loader, StepBatches, open_split, sample_sentences
from aiayn.errors import DataError
from aiayn.tokenizer import EOS_ID, PAD_ID

# ---- fixtures and helpers ----------------------------------------------------------------


def s2s_cfg(prefix: Path, **kw) -> DataConfig:
    kw = {"shuffle_buffer": 64, "max_len": 64, **kw}
    return DataConfig(format="parallel", train=str(prefix), src_lang="en", tgt_lang="de", **kw)


def lm_cfg(corpus: Path, **kw) -> DataConfig:
    kw = {"shuffle_buffer": 16, "max_len": 16, **kw}
    return DataConfig(format="text", train=str(corpus / "train.txt"), **kw)


def loader(cfg, tok, kind="seq2seq", max_tokens=200, seed=1, train=True, **kw) -> Loader:
    return stream_loader(
        cfg, cfg.train, tok, kind=kind, max_tokens=max_tokens, seed=seed, train=train, **kw
    )


def with_epochs(ld: Loader, n: int) -> list[tuple[int, Batch]]:
    it = ld.taken()
    return [(t.epoch, t.batch) for t in (next(it) for _ in range(n))]


# ---- batch content ---------------------------------------------------------------------------


def test_seq2seq_rows_hold_source_plus_eos_and_target_shifted_by_bos(corpus, tok):
    src, tgt = lines(corpus / "train.en"), lines(corpus / "train.de")
    seen = 0
    for b in loader(s2s_cfg(corpus / "train"), tok, train=False):
        assert b.src.dtype == b.tgt_in.dtype == b.ids.dtype == torch.int64
        check_pair_rows(b, src, tgt, tok)
        seen += b.size
    assert seen == 300


def test_lm_blocks_are_documents_joined_by_eos_and_shifted_by_one(lm_corpus, tok):
    cfg = lm_cfg(lm_corpus, shuffle_buffer=1000)  # one chunk: one unbroken token stream
    batches = list(loader(cfg, tok, kind="lm", max_tokens=64, train=False))
    assert all(b.size == 64 // 16 for b in batches[:-1])
    blocks = sorted(
        (i, bi, bo) for b in batches for i, bi, bo in zip(b.ids, b.tgt_in, b.tgt_out, strict=True)
    )
    assert [int(i) for i, _, _ in blocks] == list(range(len(blocks)))
    stream = [t for d in tok.encode(lines(lm_corpus / "train.txt")) for t in d + [EOS_ID]]
    rebuilt = [t for _, bi, bo in blocks for t in [int(bi[0])] + bo.tolist() if t != PAD_ID]
    assert rebuilt == stream
    for _, bi, bo in blocks:
        assert bi.shape == bo.shape == (16,)
        assert torch.equal(bi[1:], bo[:-1])


def test_classifier_batches_carry_integer_labels_and_eos_terminated_text(tmp_path, tok):
    write_classify(tmp_path, n_train=120, n_valid=10, n_test=10)
    cfg = DataConfig(format="jsonl", train=str(tmp_path / "train.jsonl"), shuffle_buffer=50)
    rows = [json.loads(line) for line in lines(tmp_path / "train.jsonl")]
    n = 0
    for b in loader(cfg, tok, kind="classifier", train=False):
        assert b.n_tokens == b.size and b.tgt_in is None
        for row, i in enumerate(b.ids.tolist()):
            assert int(b.labels[row]) == rows[i]["label"]
            ids = tok.encode([rows[i]["text"]])[0]
            assert b.src[row, : len(ids) + 1].tolist() == ids + [EOS_ID]
        n += b.size
    assert n == 120


def test_token_budget_holds_padding_included(corpus, tok):
    for max_tokens in (60, 200, 1000):
        for b in loader(s2s_cfg(corpus / "train"), tok, max_tokens=max_tokens, train=False):
            cost = b.size * max(b.src.shape[1], b.tgt_in.shape[1])
            assert cost <= max_tokens or b.size == 1


def test_an_example_wider_than_the_budget_gets_a_batch_of_its_own(corpus, tok):
    batches = list(loader(s2s_cfg(corpus / "train"), tok, max_tokens=3, train=False))
    assert all(b.size == 1 for b in batches) and len(batches) == 300
    assert max(b.src.shape[1] for b in batches) > 3


def test_bucketing_keeps_padding_low(corpus, tok):
    pad = total = 0
    for b in loader(s2s_cfg(corpus / "train", shuffle_buffer=300), tok, max_tokens=400):
        pad += int((b.tgt_out == PAD_ID).sum() + (b.src == PAD_ID).sum())
        total += b.tgt_out.numel() + b.src.numel()
        if total > 20_000:
            break
    assert pad / total < 0.25


def test_rows_of_one_width_keep_their_shuffled_order(corpus, tok):
    """Batches are cut from rows sorted by width (the longer side) alone. Sorting ties by each
    side's length as well trims padding, but fills a batch with near-identical sentences, and
    the demo learned far more slowly with it."""
    ordered, unordered = 0, 0
    batches = loader(s2s_cfg(corpus / "train", shuffle_buffer=300), tok, max_tokens=400)
    for b in itertools.islice(batches, 60):  # the training stream repeats without end
        src = (b.src != PAD_ID).sum(1).tolist()
        tgt = (b.tgt_out != PAD_ID).sum(1).tolist()
        widths = [max(s, t) for s, t in zip(src, tgt, strict=True)]
        assert widths == sorted(widths)
        for (w1, t1), (w2, t2) in itertools.pairwise(zip(widths, tgt, strict=True)):
            if w1 == w2 and t1 != t2:
                ordered += t1 < t2
                unordered += t1 > t2
    assert ordered > 0 and unordered > 0  # target lengths within a width are left mixed


# ---- shuffling and epochs ------------------------------------------------------------------


def test_every_example_appears_once_per_epoch_and_epochs_differ(corpus, tok):
    got = with_epochs(loader(s2s_cfg(corpus / "train"), tok), 90)
    epoch0 = [i for e, b in got if e == 0 for i in b.ids.tolist()]
    epoch1 = [i for e, b in got if e == 1 for i in b.ids.tolist()]
    assert sorted(epoch0) == list(range(300))
    assert sorted(epoch1) == list(range(300)) and epoch1 != epoch0


def test_same_seed_same_order_other_seed_other_order(corpus, tok):
    cfg = s2s_cfg(corpus / "train")
    a = take(iter(loader(cfg, tok, seed=5)), 20)
    b = take(iter(loader(cfg, tok, seed=5)), 20)
    c = take(iter(loader(cfg, tok, seed=6)), 20)
    assert all(same(x, y) for x, y in zip(a, b, strict=True))
    assert [x.ids.tolist() for x in a] != [x.ids.tolist() for x in c]


def test_eval_pass_is_deterministic_and_each_for_starts_over(corpus, tok):
    ld = loader(s2s_cfg(corpus / "train"), tok, train=False)
    first, second = list(ld), list(ld)
    assert len(first) == len(second) > 1
    assert all(same(x, y) for x, y in zip(first, second, strict=True))
    assert sorted(i for b in first for i in b.ids.tolist()) == list(range(300))
    other_seed = list(loader(s2s_cfg(corpus / "train"), tok, train=False, seed=9))
    assert all(same(x, y) for x, y in zip(first, other_seed, strict=True))  # no shuffling


def test_leaving_a_pass_early_stops_the_reading_thread(corpus, tok):
    # Only this test's reader counts: other tests' readers may end at any time meanwhile.
    earlier = set(threading.enumerate())

    def readers() -> int:
        new = set(threading.enumerate()) - earlier
        return sum(t.name == "aiayn-data" and t.is_alive() for t in new)

    it = iter(loader(s2s_cfg(corpus / "train", shuffle_buffer=16), tok))
    next(it)
    assert readers() == 1
    del it  # the trainer stops; the thread reading ahead must not live on
    deadline = time.monotonic() + 5
    while readers() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert readers() == 0


# ---- exact resume --------------------------------------------------------------------------


def _check_resume(make, n_ref: int, cuts: list[int], m: int) -> list[dict]:
    ref = take(iter(make()), n_ref)
    states = []
    for n in cuts:
        ld = make()
        take(iter(ld), n)
        state = roundtrip(ld.state_dict())
        states.append(state)
        fresh = make()
        fresh.load_state_dict(state)
        got = take(iter(fresh), m)
        assert all(same(x, y) for x, y in zip(got, ref[n : n + m], strict=True)), f"cut at {n}"
    return states


@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_resume_continues_with_identical_batches_mid_chunk_and_across_epochs(
    kind, corpus, lm_corpus, tok
):
    if kind == "seq2seq":
        cfg, max_tokens = s2s_cfg(corpus / "train"), 200
    else:
        cfg, max_tokens = lm_cfg(lm_corpus), 64
    make = lambda: loader(cfg, tok, kind=kind, max_tokens=max_tokens, seed=3)  # noqa: E731
    epochs = [e for e, _ in with_epochs(make(), 200)]
    per_epoch = epochs.index(1)
    cuts = [1, per_epoch // 2 + 1, per_epoch - 2, per_epoch, per_epoch + 3]
    states = _check_resume(make, per_epoch + 20, cuts, m=12)
    mid = states[1]["position"]
    assert mid["chunk"] > 0 and mid["done"] > 0, "this cut should fall inside a later chunk"
    assert states[2]["position"]["epoch"] == 0 and states[4]["position"]["epoch"] == 1


def test_resume_is_exact_for_an_eval_pass_and_for_a_jsonl_source(corpus, tok, tmp_path):
    rows = zip(lines(corpus / "train.en"), lines(corpus / "train.de"), strict=True)
    with open(tmp_path / "t.jsonl", "w") as fh:
        fh.writelines(json.dumps({"translation": {"en": e, "de": d}}) + "\n" for e, d in rows)
    jsonl = DataConfig(format="jsonl", train=str(tmp_path / "t.jsonl"), src_lang="en")
    jsonl.tgt_lang, jsonl.shuffle_buffer = "de", 64
    eval_pass = lambda: loader(s2s_cfg(corpus / "train"), tok, max_tokens=100, train=False)  # noqa: E731
    assert len(list(eval_pass())) > 19
    _check_resume(eval_pass, 19, [3, 11], m=8)
    states = _check_resume(lambda: loader(jsonl, tok), 40, [3, 11, 25], m=8)
    position = states[2]["position"]
    assert position["source"] is None and position["read"] > 0  # a count of records
    rows = zip(lines(corpus / "train.en"), lines(corpus / "train.de"), strict=True)
    (tmp_path / "t.tsv").write_text("".join(f"{e}\t{d}\n" for e, d in rows))
    tsv = dataclasses.replace(jsonl, format="tsv", train=str(tmp_path / "t.tsv"))
    states = _check_resume(lambda: loader(tsv, tok), 40, [3, 11, 25], m=8)
    assert states[2]["position"]["source"] is not None  # resumed through datasets' state_dict


def test_gzip_corpus_gives_the_same_batches_as_plain_text(corpus, tok, tmp_path):
    for suffix in ("en", "de"):
        with gzip.open(tmp_path / f"train.{suffix}.gz", "wt") as fh:
            fh.write((corpus / f"train.{suffix}").read_text())
    plain = take(iter(loader(s2s_cfg(corpus / "train"), tok)), 40)
    gz = take(iter(loader(s2s_cfg(tmp_path / "train"), tok)), 40)
    assert all(same(x, y) for x, y in zip(plain, gz, strict=True))


def test_loading_a_position_from_other_settings_is_refused(corpus, tok):
    ld = loader(s2s_cfg(corpus / "train"), tok)
    take(iter(ld), 3)
    other = loader(s2s_cfg(corpus / "train", max_len=32), tok, max_tokens=300)
    with pytest.raises(DataError) as err:
        other.load_state_dict(ld.state_dict())
    assert "max_tokens): checkpoint 200, now 300" in str(err.value)
    assert "max_len: checkpoint 64, now 32" in str(err.value)


def test_a_position_in_a_changed_corpus_is_refused_naming_what_changed(corpus, tok, tmp_path):
    """A streaming position counts records: in a corpus that grew, read the other way round or
    taken from another dataset, the same count means other records."""
    for suffix in ("en", "de"):
        (tmp_path / f"train.{suffix}").write_bytes((corpus / f"train.{suffix}").read_bytes())
    ld = loader(s2s_cfg(tmp_path / "train"), tok)
    take(iter(ld), 3)
    state = roundtrip(ld.state_dict())
    loader(s2s_cfg(tmp_path / "train"), tok).load_state_dict(state)  # unchanged: resumes
    with (tmp_path / "train.de").open("ab") as fh:
        fh.write(b"noch ein satz\n")
    with (tmp_path / "train.en").open("ab") as fh:
        fh.write(b"one more sentence\n")
    with pytest.raises(DataError) as err:
        loader(s2s_cfg(tmp_path / "train"), tok).load_state_dict(state)
    grown = tmp_path.resolve() / "train.de"
    assert f"{grown}: checkpoint {len((corpus / 'train.de').read_bytes())} bytes" in str(err.value)
    reversed_cfg = dataclasses.replace(s2s_cfg(tmp_path / "train"), src_lang="de", tgt_lang="en")
    with pytest.raises(DataError, match="fields read: checkpoint"):
        loader(reversed_cfg, tok).load_state_dict(state)


def test_a_corpus_edited_in_place_at_the_same_size_is_refused_and_a_touch_resumes(
    corpus, tok, tmp_path, caplog
):
    """ "one" -> "uno" in the first 200 lines keeps every file's size: the saved position would
    count records of other text. The first MiB's sha256 tells, and the refusal names the file
    and what changed; a new modification time alone (a copy, `touch`) resumes, said in the log."""
    for suffix in ("en", "de"):
        (tmp_path / f"train.{suffix}").write_bytes((corpus / f"train.{suffix}").read_bytes())
    ld = loader(s2s_cfg(tmp_path / "train"), tok)
    take(iter(ld), 3)
    state = roundtrip(ld.state_dict())
    path = tmp_path / "train.en"
    os.utime(path, ns=(1, 1))
    with caplog.at_level("WARNING", logger="aiayn.data.position"):
        loader(s2s_cfg(tmp_path / "train"), tok).load_state_dict(state)
    assert f"{path.resolve()} was modified since the checkpoint" in caplog.text
    text = path.read_text().splitlines(keepends=True)
    edited = "".join(line.replace("one", "uno") for line in text[:200]) + "".join(text[200:])
    assert len(edited) == len("".join(text)) and edited != "".join(text)
    path.write_text(edited)
    with pytest.raises(DataError) as err:
        loader(s2s_cfg(tmp_path / "train"), tok).load_state_dict(state)
    msg = str(err.value)
    assert f"{path.resolve()}: edited in place since the checkpoint" in msg
    assert "its first and last MiB changed" in msg and "new run_dir" in msg
    assert "train.de" not in msg


def test_a_hub_positions_identity_is_the_dataset_not_files():
    from aiayn.data.splits import source_identity

    cfg = DataConfig(
        format="hub", hub_name="wmt/wmt14", hub_config="de-en", train="train", src_lang="de"
    )
    assert source_identity(cfg, "train", "seq2seq") == {
        "fields": {"src_lang": "de", "tgt_lang": "en", "src_field": None, "tgt_field": None},
        "hub": {"name": "wmt/wmt14", "config": "de-en", "revision": None},
    }


# ---- ranks -------------------------------------------------------------------------------


def test_two_ranks_take_alternate_batches_of_the_single_rank_stream(corpus, tok):
    cfg = s2s_cfg(corpus / "train")
    single = take(iter(loader(cfg, tok)), 80)
    r0, r1 = (loader(cfg, tok, rank=r, world_size=2) for r in (0, 1))
    b0, b1 = take(iter(r0), 40), take(iter(r1), 40)
    interleaved = [b for pair in zip(b0, b1, strict=True) for b in pair]
    assert all(same(x, y) for x, y in zip(interleaved, single, strict=True))
    assert r0.state_dict() == r1.state_dict()  # the position is the group's, not the rank's
    one_pass = [list(loader(cfg, tok, train=False, rank=r, world_size=2)) for r in (0, 1)]
    pass_ids = [[i for b in p for i in b.ids.tolist()] for p in one_pass]
    assert not set(pass_ids[0]) & set(pass_ids[1])
    assert sorted(pass_ids[0] + pass_ids[1]) == list(range(300))


def test_a_position_saved_on_two_ranks_resumes_on_one_and_back(corpus, tok):
    cfg = s2s_cfg(corpus / "train")
    single = take(iter(loader(cfg, tok)), 60)
    r1 = loader(cfg, tok, rank=1, world_size=2)
    take(iter(r1), 13)  # the group has consumed 26 global batches
    one = loader(cfg, tok)
    one.load_state_dict(roundtrip(r1.state_dict()))
    assert all(same(x, y) for x, y in zip(take(iter(one), 10), single[26:36], strict=True))
    two = loader(cfg, tok, rank=1, world_size=2)
    two.load_state_dict(roundtrip(one.state_dict()))  # 36 consumed; rank 1 takes 37, 39, ...
    assert all(same(x, y) for x, y in zip(take(iter(two), 5), single[37:47:2], strict=True))


# ---- bad corpora -----------------------------------------------------------------------------


def _write_pair(prefix: Path, src: list[bytes], tgt: list[bytes]) -> None:
    prefix.with_suffix(".en").write_bytes(b"".join(line + b"\n" for line in src))
    prefix.with_suffix(".de").write_bytes(b"".join(line + b"\n" for line in tgt))


def test_missing_corpus_file_names_the_paths_looked_for(tmp_path, tok):
    (tmp_path / "c.en").write_text("one\n")
    with pytest.raises(DataError) as err:
        loader(s2s_cfg(tmp_path / "c"), tok)
    assert f"{tmp_path}/c.de (or {tmp_path}/c.de.gz)" in str(err.value)
    assert "c.en" not in str(err.value)


def test_parallel_files_of_different_lengths_report_both_counts(tmp_path, tok):
    _write_pair(tmp_path / "c", [b"one", b"two", b"three"], [b"eins", b"zwei"])
    with pytest.raises(DataError) as err:
        loader(s2s_cfg(tmp_path / "c"), tok)
    msg = str(err.value)
    assert f"{tmp_path}/c.en has 3 lines" in msg and f"{tmp_path}/c.de has 2" in msg


def test_empty_corpus_is_refused_by_name(tmp_path, tok):
    _write_pair(tmp_path / "c", [], [])
    with pytest.raises(DataError, match=r"corpus .*/c is empty"):
        loader(s2s_cfg(tmp_path / "c"), tok)
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match=r"e\.jsonl is empty"):
        loader(DataConfig(format="jsonl", train=str(tmp_path / "e.jsonl")), tok)


def test_invalid_utf8_pair_is_skipped_and_counted(tmp_path, tok):
    src = [b"one", b"tw\xffo", b"three", b"four"]
    _write_pair(tmp_path / "c", src, [b"eins", b"zwei", b"drei", b"vier\xc3"])
    ld = loader(s2s_cfg(tmp_path / "c"), tok, train=False)
    got = [tok.decode(b.src.tolist()) for b in ld]
    assert sorted(t for texts in got for t in texts) == ["one", "three"]
    assert ld.stats()["invalid_utf8_skipped"] == 2
    assert ld.stats()["examples_read"] == 2


def test_invalid_utf8_line_raises_with_file_and_line_when_set_to_error(tmp_path, tok):
    _write_pair(tmp_path / "c", [b"one", b"two", b"three"], [b"eins", b"zw\xffei", b"drei"])
    with pytest.raises(DataError) as err:
        loader(s2s_cfg(tmp_path / "c", on_invalid_utf8="error"), tok)
    assert f"{tmp_path}/c.de line 2 is not valid UTF-8" in str(err.value)


def test_too_long_and_empty_examples_are_dropped_and_counted(corpus, tok):
    src, tgt = lines(corpus / "train.en"), lines(corpus / "train.de")
    lens = [max(len(s), len(t)) for s, t in zip(tok.encode(src), tok.encode(tgt), strict=True)]
    max_len = sorted(lens)[len(lens) // 2]  # about half are longer
    expected_long = sum(n > max_len for n in lens)
    ld = loader(s2s_cfg(corpus / "train", max_len=max_len), tok, train=False)
    ids = [i for b in ld for i in b.ids.tolist()]
    assert ld.stats()["dropped_too_long"] == expected_long > 0
    assert sorted(ids) == [i for i, n in enumerate(lens) if n <= max_len]


def test_empty_lines_are_dropped_and_a_corpus_of_only_those_is_an_error(tmp_path, tok):
    _write_pair(tmp_path / "c", [b"one", b"", b"three"], [b"eins", b"zwei", b""])
    ld = loader(s2s_cfg(tmp_path / "c"), tok, train=False)
    assert [b.ids.tolist() for b in ld] == [[0]]
    assert ld.stats()["dropped_empty"] == 2
    _write_pair(tmp_path / "d", [b"", b"two"], [b"eins", b""])
    with pytest.raises(DataError, match="gives no batches: of 2 examples read, 0 are longer"):
        next(iter(loader(s2s_cfg(tmp_path / "d"), tok)))


# ---- sources with fields -------------------------------------------------------------------


def test_jsonl_tsv_and_parquet_sources_read_their_fields(tmp_path):
    rec = {"meta": {"pair": {"en": "one", "de": "eins"}}, "en": "two", "de": "zwei"}
    (tmp_path / "a.jsonl").write_text(json.dumps(rec) + "\n")
    cfg = DataConfig(format="jsonl", train=str(tmp_path / "a.jsonl"), src_lang="en")
    cfg.tgt_lang = "de"
    assert list(open_split(cfg, cfg.train, "seq2seq")) == [{"src": "two", "tgt": "zwei"}]
    cfg.src_field, cfg.tgt_field = "meta.pair.en", "meta.pair.de"
    assert list(open_split(cfg, cfg.train, "seq2seq")) == [{"src": "one", "tgt": "eins"}]

    (tmp_path / "a.tsv").write_text('say "hi"\tNA\nthree\t\n')
    cfg = DataConfig(format="tsv", train=str(tmp_path / "a.tsv"))
    got = list(open_split(cfg, cfg.train, "seq2seq"))
    assert got == [{"src": 'say "hi"', "tgt": "NA"}, {"src": "three", "tgt": ""}]
    (tmp_path / "c.tsv").write_text("one\t1\ntwo\t0\n")
    cfg = DataConfig(format="tsv", train=str(tmp_path / "c.tsv"))
    assert [r["label"] for r in open_split(cfg, cfg.train, "classifier")] == [1, 0]

    pd.DataFrame({"doc": ["a b", "c d"], "y": [0, 1]}).to_parquet(tmp_path / "p.parquet")
    cfg = DataConfig(format="parquet", train=str(tmp_path / "p.parquet"), text_field="doc")
    cfg.label_field = "y"
    assert list(open_split(cfg, cfg.train, "classifier")) == [
        {"text": "a b", "label": 0},
        {"text": "c d", "label": 1},
    ]


def test_a_missing_field_names_it_and_the_fields_there_are(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"source": "one", "target": "eins"}) + "\n")
    cfg = DataConfig(format="jsonl", train=str(tmp_path / "a.jsonl"), src_lang="en")
    with pytest.raises(DataError) as err:
        open_split(cfg, cfg.train, "seq2seq")
    assert "no field en or translation.en" in str(err.value)
    assert "['source', 'target']" in str(err.value) and "data.src_field" in str(err.value)


def test_hub_source_calls_load_dataset_streaming_with_name_config_and_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        pairs = [{"translation": {"de": "eins", "en": "one"}}]
        return datasets.IterableDataset.from_generator(lambda: iter(pairs))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(format="hub", hub_name="wmt14", hub_config="de-en", train="train")
    assert list(open_split(cfg, "validation", "seq2seq")) == [{"src": "eins", "tgt": "one"}]
    assert calls[0] == (("wmt14", "de-en"), {"split": "validation", "streaming": True})


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (ConnectionError("Couldn't reach 'wmt/wmt14' on the Hub (ConnectTimeout)"), "network"),
        (FileNotFoundError("Dataset 'nobody/nothing' doesn't exist on the Hub"), "hub_name"),
        (
            RuntimeError("Dataset scripts are no longer supported, but found wmt14.py"),
            "script-free",
        ),
    ],
)
def test_a_hub_error_at_open_is_a_data_error_saying_what_to_check(monkeypatch, error, said):
    """Not an exception a launcher restarts and blames a node for: any node would meet it."""
    import datasets

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", fail)
    cfg = DataConfig(format="hub", hub_name="wmt/wmt14", hub_config="de-en", train="train")
    with pytest.raises(DataError, match="could not read the Hub dataset wmt/wmt14") as err:
        open_split(cfg, "train", "seq2seq")
    assert said in str(err.value) and type(error).__name__ in str(err.value)


def test_a_hub_error_mid_stream_is_a_data_error_and_a_bug_stays_a_bug(monkeypatch):
    import datasets

    def records(fault):
        yield {"translation": {"de": "eins", "en": "one"}}
        raise fault

    for fault, expected in (
        (ConnectionError("Read timed out"), DataError),
        (KeyError("x"), KeyError),
    ):
        monkeypatch.setattr(
            datasets,
            "load_dataset",
            lambda *a, fault=fault, **kw: datasets.IterableDataset.from_generator(
                records, gen_kwargs={"fault": fault}
            ),
        )
        source = open_split(DataConfig(format="hub", hub_name="x/y", train="t"), "t", "seq2seq")
        with pytest.raises(expected):
            list(source)


def test_an_offline_node_gets_the_same_one_line_error(tmp_path):
    """The real path, in a process of its own (the Hub libraries read HF_HUB_OFFLINE and
    HF_HOME when imported): offline, and a dataset that is in no cache."""
    script = (
        "from aiayn.config import DataConfig\n"
        "from aiayn.data import open_split\n"
        "from aiayn.errors import DataError\n"
        "cfg = DataConfig(format='hub', hub_name='nobody/no-such-dataset', train='train')\n"
        "try:\n"
        "    open_split(cfg, 'train', 'seq2seq')\n"
        "except DataError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.stdout.startswith("could not read the Hub dataset nobody/no-such-dataset"), (
        out.stdout + out.stderr[-2000:]
    )


def test_parallel_prefix_glob_reads_every_shard(tmp_path, tok):
    _write_pair(tmp_path / "part1", [b"one", b"two"], [b"eins", b"zwei"])
    _write_pair(tmp_path / "part2", [b"three"], [b"drei"])
    cfg = s2s_cfg(tmp_path / "part*")
    assert [r["src"] for r in open_split(cfg, cfg.train, "seq2seq")] == ["one", "two", "three"]


def test_line_files_are_read_whole_by_shard_and_from_a_count_by_the_projects_reader(tmp_path):
    """Parallel and text files are read by the project's reader everywhere (data/source.py):
    its shards are its file groups in order, and a stream resumed after k records gives the
    records after the first k, lines that are not UTF-8 skipped either way."""
    _write_pair(tmp_path / "part1", [b"one", b"t\xffwo", b" two "], [b"eins", b"zwei", b"zwei"])
    _write_pair(tmp_path / "part2", [b"three"], [b"drei"])
    (tmp_path / "t1.txt").write_bytes(b" a  line \n\nb\xff\nlast")
    (tmp_path / "t2.txt").write_bytes(b"c\n")
    text = DataConfig(format="text", train=str(tmp_path / "t*.txt"), on_invalid_utf8="skip")
    for cfg, kind, want in (
        (s2s_cfg(tmp_path / "part*", on_invalid_utf8="skip"), "seq2seq", ["one", "two", "three"]),
        (text, "lm", [" a  line ", "", "last", "c"]),  # an empty line is a record: the loader
    ):  # drops it, and counts it
        source = open_split(cfg, cfg.train, kind)
        records = list(source)
        assert [r.get("src", r.get("text")) for r in records] == want
        assert source.num_shards() == 2
        assert [r for i in range(2) for r in source.shard_records(i)] == records
        for k in range(len(records) + 1):
            stream = source.stream(None, k)
            assert list(stream) == records[k:] and stream.state() is None


def test_jsonl_records_are_normalised_and_a_json_array_is_refused(corpus, tok, tmp_path):
    """JSON Lines files, read by the project's reader: blank lines skipped, a field some
    records lack read as empty, nesting, gzip and bzip2, a file a shard. A JSON array, a bad
    line, or a compression it does not read is a DataError that names the file and the fix."""
    rows = [{"translation": {"en": e, "de": d}} for e, d in zip(
        lines(corpus / "train.en"), lines(corpus / "train.de"), strict=True)]  # fmt: skip
    rows[3] = {"translation": {"en": "no target here"}, "note": 1}
    rows[5]["translation"]["de"] = None
    text = [json.dumps(r, ensure_ascii=False) for r in rows]
    (tmp_path / "a.jsonl").write_text("\n".join(text[:300]) + "\n\n  \n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as fh:
        fh.write("\n".join(text[300:400]))
    with bz2.open(tmp_path / "c.jsonl.bz2", "wt") as fh:
        fh.write("\n".join(text[400:]))
    cfg = DataConfig(format="jsonl", train=str(tmp_path / "*.jsonl*"), src_lang="en")
    cfg.tgt_lang, cfg.shuffle_buffer, cfg.max_len = "de", 64, 64
    source = open_split(cfg, cfg.train, "seq2seq")
    records = list(source)
    assert len(records) == len(rows) and records[0]["src"] == rows[0]["translation"]["en"]
    assert records[3] == {"src": "no target here", "tgt": ""} and records[5]["tgt"] == ""
    assert source.num_shards() == 3
    assert [r for i in range(3) for r in source.shard_records(i)] == records

    (tmp_path / "arr.json").write_text(json.dumps(rows[:2]))
    array = dataclasses.replace(cfg, train=str(tmp_path / "arr.json"))
    with pytest.raises(DataError, match=r"arr.json line 1 holds a JSON list.*jq -c"):
        open_split(array, array.train, "seq2seq")
    (tmp_path / "bad.jsonl").write_text(text[0] + "\n" + text[1][:-3] + "\n")
    bad = dataclasses.replace(cfg, train=str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataError, match=r"bad.jsonl line 2 is not a JSON record"):
        list(open_split(bad, bad.train, "seq2seq"))
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    zst = dataclasses.replace(cfg, train=str(tmp_path / "d.jsonl.zst"))
    with pytest.raises(DataError, match=r"d.jsonl.zst: data.format jsonl reads plain, .gz"):
        open_split(zst, zst.train, "seq2seq")


def test_a_token_cache_and_validation_on_the_run_copy_do_not_import_datasets(corpus, tmp_path):
    """0.7 s of CPU in every process that trains a tokenizer, builds a cache or validates
    (on the run's jsonl copy of the dev set: its batches and its sentences to translate)."""
    code = f"""
import itertools, sys
from aiayn.config import load_config
from aiayn.data import make_loader, open_split, sample_sentences
from aiayn.data.cache import ensure_cache
from aiayn.data.split_copies import with_run_copy
from aiayn.tokenizer import Tokenizer, train_tokenizer
cfg = load_config(None, ["data.train={corpus}/train", "data.valid={corpus}/valid",
    "data.cache_dir={tmp_path}/cache", "tokenizer.path={tmp_path}/spm.model",
    "tokenizer.vocab_size=60", "run_dir={tmp_path}/run"])
train_tokenizer(cfg.tokenizer, sample_sentences(cfg.data, "seq2seq", 500, 1), cfg.tokenizer_path)
tok = Tokenizer(cfg.tokenizer_path)
ensure_cache(cfg, "train", tok)
cfg = with_run_copy(cfg, "valid")
assert cfg.data.format == "jsonl", cfg.data
batches = list(make_loader(cfg, cfg.data.valid, tok, train=False))
pairs = list(itertools.islice(open_split(cfg.data, cfg.data.valid, "seq2seq"), 10))
assert batches and len(pairs) == 10
print("datasets" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "False"


def test_sentence_sample_is_bounded_deterministic_and_has_both_sides(corpus):
    cfg = s2s_cfg(corpus / "train")
    a = sample_sentences(cfg, "seq2seq", 100, seed=1)
    assert len(a) == 100 and a == sample_sentences(cfg, "seq2seq", 100, seed=1)
    assert a != sample_sentences(cfg, "seq2seq", 100, seed=2)
    en, de = set(lines(corpus / "train.en")), set(lines(corpus / "train.de"))
    assert set(a) <= en | de and set(a) & en and set(a) & de
    assert len(sample_sentences(cfg, "seq2seq", 10_000, seed=1)) == 600


def test_a_step_refused_at_the_epoch_limit_gives_its_batches_back(corpus, tok):
    cfg = s2s_cfg(corpus / "train")
    ref = take(iter(loader(cfg, tok, seed=5)), 200)
    ld = loader(cfg, tok, seed=5, per_round=3)
    with StepBatches(ld, max_epochs=1) as steps:
        trained, past = [], False
        while not past:
            fetched = steps.next()
            trained += [t.batch for t in fetched]
            past = steps.group_totals()[1]
        refused_epochs = [t.epoch for t in fetched]
        steps.give_back()
    trained = trained[:-3]
    assert refused_epochs[-1] == 1 and len(trained) % 3 == 0
    assert all(same(x, y) for x, y in zip(trained, ref, strict=False))
    # The loader continues with the refused step's batches, the first of them from epoch 0
    # unless the epoch's batches divide into steps.
    resumed = loader(cfg, tok, seed=5)
    resumed.load_state_dict(roundtrip(ld.state_dict()))
    assert resumed.epoch == 0
    got = take(iter(resumed), 6)
    assert all(same(x, y) for x, y in zip(got, ref[len(trained) : len(trained) + 6], strict=True))
