"""A Hub training split is read from the Hub once, into local parquet parts; the token cache, the
tokenizer's sample and a stream then read the parts, and give what the Hub's stream gave."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
from batch_checks import same, take

from aiayn.config import Config, DataConfig, ModelConfig, TrainConfig
from aiayn.data import ensure_cache, hub_copy, make_loader, sample_sentences

from helpers import hub_dataset  # tests/helpers.py


def hub_cfg(run_dir: Path, folder: Path, **data) -> Config:
    data = {"shuffle_buffer": 64, "max_len": 64, **data}
    return Config(
        run_dir=str(run_dir),
        model=ModelConfig(kind="seq2seq", max_len=128),
        data=DataConfig(
            format="hub",
            hub_name=str(folder),
            hub_config="de-en",
            train="train",
            src_field="translation.en",
            tgt_field="translation.de",
            **data,
        ),  # fmt: skip
        train=TrainConfig(max_tokens=200, seed=3),
    )


def arrays(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.suffix == ".npy"}


def test_the_hub_is_read_once_and_the_copy_gives_the_streams_cache_stream_and_sample(
    tmp_path, corpus, tok, monkeypatch
):
    monkeypatch.setattr(hub_copy, "_PART_ROWS", 70)  # 3 Hub files of 100: parts of 70 and 30
    folder = hub_dataset(tmp_path / "hub", corpus, train_files=3)
    direct = hub_cfg(tmp_path / "direct", folder)  # today's path: the Hub streamed
    streamed = ensure_cache(direct, "train", tok)
    stream_batches = take(iter(make_loader(direct, "train", tok, train=True)), 3)
    sample = sample_sentences(direct.data, "seq2seq", 50, seed=1)

    # Every record the Hub yields while the copy is made, counted.
    read = [0]
    real_load = datasets.load_dataset

    def counted(*args, **kwargs):
        ds = real_load(*args, **kwargs)
        if args and args[0] == str(folder):

            def count(rec):
                read[0] += 1
                return rec

            return ds.map(count)
        return ds

    monkeypatch.setattr(datasets, "load_dataset", counted)
    cfg = hub_cfg(tmp_path / "run", folder)
    parts = hub_copy.materialise(cfg)
    assert read[0] == 300  # each record once, every Hub file by the one rank
    manifest = json.loads((hub_copy.copy_dir(cfg) / hub_copy.MANIFEST).read_text())
    assert manifest["rows"] == 300 and manifest["hub_files"] == 3
    assert [p["rows"] for p in manifest["parts"]] == [70, 30] * 3
    assert parts == sorted(parts) and [Path(p).name for p in parts][:2] == [
        "part-00000-00000.parquet",
        "part-00000-00001.parquet",
    ]

    # From here the Hub is gone, and offline: every read below is the copy's.
    shutil.rmtree(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_copy.materialise(cfg) == parts and read[0] == 300  # not copied again
    cache = ensure_cache(cfg, "train", tok, local=parts)
    assert arrays(cache.root) == arrays(streamed.root)  # the same tokens, ids and offsets
    assert cache.manifest["fingerprint"] == streamed.manifest["fingerprint"]  # the Hub's name
    assert cache.digest == streamed.digest
    local = make_loader(hub_cfg(tmp_path / "run", folder, cache=False), "train", tok, train=True)
    assert all(same(a, b) for a, b in zip(take(iter(local), 3), stream_batches, strict=True))
    assert sample_sentences(cfg.data, "seq2seq", 50, seed=1, local=parts) == sample
    assert read[0] == 300


def test_a_json_hub_split_is_copied_record_for_record(tmp_path, monkeypatch):
    """A Hub split of JSON lines files (types inferred by datasets, a field null throughout
    some parts) is copied in order, and reads back record for record as the stream gave it."""
    monkeypatch.setattr(hub_copy, "_PART_ROWS", 4)
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    rows = [{"text": f"line {i}", "note": None if i >= 4 else f"n{i}"} for i in range(10)]
    for f, chunk in enumerate((rows[:6], rows[6:])):
        lines = "".join(json.dumps(r) + "\n" for r in chunk)
        (folder / "data" / f"train-{f}.jsonl").write_text(lines)
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        model=ModelConfig(kind="lm", max_len=64),
        data=DataConfig(format="hub", hub_name=str(folder), train="train", text_field="text"),
    )
    parts = hub_copy.materialise(cfg)
    assert [Path(p).name for p in parts] == [
        "part-00000-00000.parquet",
        "part-00000-00001.parquet",
        "part-00001-00000.parquet",
    ]
    from aiayn.data import open_split

    copied = list(open_split(cfg.data, "train", "lm", local=parts))
    assert copied == list(open_split(cfg.data, "train", "lm"))
    assert [r["text"] for r in copied] == [r["text"] for r in rows]


def test_a_run_without_a_hub_split_makes_no_copy(tmp_path, corpus):
    cfg = hub_cfg(tmp_path / "run", tmp_path / "hub")
    text = Config(run_dir=str(tmp_path / "run"), data=DataConfig(format="parallel", train="x"))
    assert hub_copy.materialise(text) is None and hub_copy.local_parts(text) is None
    assert hub_copy.local_parts(cfg) is None  # a Hub split not copied yet: streamed as before
