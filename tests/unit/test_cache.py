"""The token cache and the loader that plans batches from it: content, plans, ranks, exact
resume, and the errors a stale or damaged cache gives."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from batch_checks import check_pair_rows, check_plans_kept, lines, roundtrip, same, take

from aiayn.config import Config, DataConfig, ModelConfig, TokenizerConfig, TrainConfig
from aiayn.corpora.demo import write_classify
from aiayn.data import Loader, StepBatches, ensure_cache, make_loader, plan
from aiayn.data.cache import MANIFEST, cache_dir, open_cache
from aiayn.data.plan import budget_bounds, pair_plan, sorted_bounds
from aiayn.errors import DataError
from aiayn.runtime.durable import sha256_of
from aiayn.tokenizer import EOS_ID, PAD_ID, train_tokenizer

# ---- fixtures and helpers ----------------------------------------------------------------


def s2s(run_dir: Path, prefix: Path, kind="seq2seq", fmt="parallel", **data) -> Config:
    data = {"shuffle_buffer": 64, "max_len": 64, **data}
    return Config(
        run_dir=str(run_dir),
        model=ModelConfig(kind=kind, max_len=128),
        data=DataConfig(format=fmt, train=str(prefix), src_lang="en", tgt_lang="de", **data),
        train=TrainConfig(max_tokens=200, seed=3),
    )


def lm(run_dir: Path, corpus: Path, **data) -> Config:
    data = {"shuffle_buffer": 16, "max_len": 16, **data}
    return Config(
        run_dir=str(run_dir),
        model=ModelConfig(kind="lm", max_len=64),
        data=DataConfig(format="text", train=str(corpus / "train.txt"), **data),
        train=TrainConfig(max_tokens=64, seed=3),
    )


def cached(cfg: Config, tok, train=True, rank=0, world_size=1) -> Loader:
    cache = ensure_cache(cfg, "train", tok)
    return make_loader(
        cfg, cfg.data.train, tok, train=train, rank=rank, world_size=world_size, cache=cache
    )


def steps(loader: Loader, n: int) -> list[list]:
    """The loader's next `n` optimizer steps on its rank, as the training loop takes them."""
    with StepBatches(loader, None) as batches:
        return [batches.next() for _ in range(n)]


def cache_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


# ---- plans -------------------------------------------------------------------------------


@pytest.mark.parametrize("group_rows", [plan._GROUP_ROWS, 50])
def test_the_sorted_cut_equals_the_greedy_cut_batch_by_batch(monkeypatch, group_rows):
    monkeypatch.setattr(plan, "_GROUP_ROWS", group_rows)  # 50: windows cut in many groups
    for trial in range(300):
        r = np.random.default_rng(trial)
        n, window, budget = int(r.integers(1, 400)), int(r.integers(1, 90)), int(r.integers(1, 300))
        width = np.concatenate(
            [np.sort(r.integers(1, 60, n)[lo : lo + window]) for lo in range(0, n, window)]
        )
        expected = [0]
        for lo in range(0, n, window):
            expected += (budget_bounds(width[lo : lo + window], budget)[1:] + lo).tolist()
        got = sorted_bounds(width, window, budget)
        assert got.tolist() == expected, f"trial {trial}"


def test_both_ways_of_permuting_give_numpys_permutation(monkeypatch):
    keep = np.flatnonzero(np.random.default_rng(0).integers(0, 3, 5000)).astype(np.int32)
    expected = np.random.default_rng([7, 1]).permutation(keep)
    for group_rows in (1 << 20, 100):  # below it: gather by an int64 permutation; above: shuffle
        monkeypatch.setattr(plan, "_GROUP_ROWS", group_rows)
        got = plan._permuted(keep, np.random.default_rng([7, 1]))
        assert got.dtype == keep.dtype and got.tolist() == expected.tolist()


def test_a_plan_holds_every_kept_example_once_within_the_budget():
    r = np.random.default_rng(0)
    width = r.integers(2, 40, 5000).astype(np.int32)
    keep = np.flatnonzero(width < 35)
    plan = pair_plan(width, keep, 300, 700, np.random.default_rng(1))
    assert sorted(plan.rows.tolist()) == keep.tolist()
    costs = [len(plan.batch(k)) * width[plan.batch(k)].max() for k in range(len(plan))]
    assert max(costs) <= 300
    # Batches are shuffled across the whole epoch: widths do not rise batch after batch.
    first_width = [int(width[plan.batch(k)][0]) for k in range(len(plan))]
    assert first_width != sorted(first_width)


# ---- content -------------------------------------------------------------------------------


def test_seq2seq_rows_are_the_tokenized_pairs_with_eos_and_bos(tmp_path, corpus, tok):
    src, tgt = lines(corpus / "train.en"), lines(corpus / "train.de")
    seen = []
    for b in cached(s2s(tmp_path, corpus / "train"), tok, train=False):
        check_pair_rows(b, src, tgt, tok)
        seen += b.ids.tolist()
    assert sorted(seen) == list(range(300))


def test_the_cached_eval_pass_equals_the_streamed_one(tmp_path, corpus, tok):
    """Same windows, same order, same batches: only where the tokens come from differs."""
    cfg = s2s(tmp_path, corpus / "train")
    streamed = list(make_loader(cfg, cfg.data.train, tok, train=False))
    from_cache = list(cached(cfg, tok, train=False))
    assert len(streamed) == len(from_cache)
    assert all(same(a, b) for a, b in zip(streamed, from_cache, strict=True))


def test_every_example_once_per_epoch_and_epochs_differ(tmp_path, corpus, tok):
    ld = cached(s2s(tmp_path, corpus / "train"), tok)
    it, epochs = iter(ld), {0: [], 1: [], 2: []}
    while ld.epoch < 3:
        b = next(it)
        if ld.epoch < 3:
            epochs[ld.epoch] += b.ids.tolist()
    assert all(sorted(ids) == list(range(300)) for ids in epochs.values())
    assert epochs[0] != epochs[1] != epochs[2]


def test_the_next_epochs_plan_is_made_ahead_and_equals_a_fresh_one(tmp_path, corpus, tok):
    cfg = s2s(tmp_path, corpus / "train")
    ld = cached(cfg, tok)
    it = iter(ld)
    next(it)
    assert any(t.name.startswith("aiayn-plan") for t in threading.enumerate())
    while ld.epoch < 1:
        next(it)
    ahead, fresh = ld.rows.plan(1)[0], cached(cfg, tok).rows.plan(1)[0]
    assert len(ahead) == len(fresh) > 1
    assert all(ahead.batch(k).tolist() == fresh.batch(k).tolist() for k in range(len(fresh)))


def test_lm_blocks_are_the_permuted_documents_joined_by_eos(tmp_path, lm_corpus, tok):
    ld = cached(lm(tmp_path, lm_corpus), tok)
    it = iter(ld)
    blocks = []
    while ld.epoch == 0:
        b = next(it)
        if ld.epoch == 0:
            assert b.tgt_in.shape[1] == 16 and torch.equal(b.tgt_in[:, 1:], b.tgt_out[:, :-1])
            blocks += [[int(r[0])] + o.tolist() for r, o in zip(b.tgt_in, b.tgt_out, strict=True)]
    stream = [t for block in blocks for t in block if t != PAD_ID]
    docs = [tuple(d) for d in tok.encode(lines(lm_corpus / "train.txt"))]
    got = [tuple(d) for d in _split(stream, EOS_ID)]
    assert sorted(got) == sorted(docs)  # each document once, whole
    assert got != docs  # in a shuffled order


def _split(stream: list[int], sep: int) -> list[list[int]]:
    out, doc = [], []
    for t in stream:
        if t == sep:
            out.append(doc)
            doc = []
        else:
            doc.append(t)
    return out


def test_classifier_batches_carry_labels(tmp_path, tok):
    write_classify(tmp_path, n_train=120, n_valid=10, n_test=10)
    cfg = s2s(tmp_path, tmp_path / "train.jsonl", kind="classifier", fmt="jsonl")
    rows = [json.loads(line) for line in lines(tmp_path / "train.jsonl")]
    n = 0
    for b in cached(cfg, tok, train=False):
        assert b.n_tokens == b.size and b.labels.tolist() == [rows[i]["label"] for i in b.ids]
        n += b.size
    assert n == 120


def test_too_long_and_empty_examples_are_counted(tmp_path, tok):
    (tmp_path / "c.en").write_text("one\n\nthree hundred and five\nfour\n")
    (tmp_path / "c.de").write_text("eins\nzwei\ndrei hundert und fünf\n\n")
    ld = cached(s2s(tmp_path, tmp_path / "c", max_len=4), tok, train=False)
    assert [i for b in ld for i in b.ids.tolist()] == [0]
    stats = ld.stats()
    assert (stats["dropped_empty"], stats["dropped_too_long"], stats["examples_read"]) == (2, 1, 4)


# ---- ranks and resume ------------------------------------------------------------------


def test_ranks_take_alternate_batches_of_the_single_rank_stream(tmp_path, corpus, tok):
    cfg = s2s(tmp_path, corpus / "train")
    single = take(iter(cached(cfg, tok)), 120)
    for world in (2, 3):
        per_rank = [
            take(iter(cached(cfg, tok, rank=r, world_size=world)), 40) for r in range(world)
        ]
        interleaved = [b for group in zip(*per_rank, strict=True) for b in group]
        assert all(same(x, y) for x, y in zip(interleaved, single[: 40 * world], strict=True))


@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_resume_mid_epoch_and_across_epochs_gives_identical_batches(
    kind, tmp_path, corpus, lm_corpus, tok
):
    cfg = s2s(tmp_path, corpus / "train") if kind == "seq2seq" else lm(tmp_path, lm_corpus)
    ld = cached(cfg, tok)
    it = iter(ld)
    per_epoch = next(k for k in itertools.count() if (next(it), ld.epoch)[1] == 1)
    ref = take(iter(cached(cfg, tok)), 2 * per_epoch + 10)
    for cut in (1, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 3):
        ld = cached(cfg, tok)
        take(iter(ld), cut)
        fresh = cached(cfg, tok)
        fresh.load_state_dict(roundtrip(ld.state_dict()))
        got = take(iter(fresh), 10)
        assert all(same(x, y) for x, y in zip(got, ref[cut : cut + 10], strict=True)), cut


def test_a_position_saved_on_two_ranks_resumes_on_three_and_on_one(tmp_path, corpus, tok):
    cfg = s2s(tmp_path, corpus / "train")
    single = take(iter(cached(cfg, tok)), 90)
    r1 = cached(cfg, tok, rank=1, world_size=2)
    take(iter(r1), 13)  # the group has consumed 26 global batches
    state = roundtrip(r1.state_dict())
    one = cached(cfg, tok)
    one.load_state_dict(state)
    assert all(same(x, y) for x, y in zip(take(iter(one), 10), single[26:36], strict=True))
    three = cached(cfg, tok, rank=2, world_size=3)
    three.load_state_dict(state)  # rank 2 of 3 takes global batches 28, 31, ...
    assert all(same(x, y) for x, y in zip(take(iter(three), 5), single[28:43:3], strict=True))


def test_the_other_loaders_position_or_other_settings_are_refused(tmp_path, corpus, tok):
    cfg = s2s(tmp_path, corpus / "train")
    streamed = make_loader(cfg, cfg.data.train, tok, train=True)
    take(iter(streamed), 2)
    with pytest.raises(DataError, match="streaming loader's .data.cache=false.: resume with"):
        cached(cfg, tok).load_state_dict(streamed.state_dict())
    ld = cached(cfg, tok)
    take(iter(ld), 2)
    with pytest.raises(DataError, match="token cache's: resume with data.cache=true"):
        make_loader(cfg, cfg.data.train, tok, train=True).load_state_dict(ld.state_dict())
    cfg.train.max_tokens = 300
    # Another max_tokens without train.unit_tokens is another plan: refused, with the setting
    # that keeps the plan and takes forwards of the new size.
    with pytest.raises(DataError, match=r"max_tokens\): checkpoint 200, now 300.*unit_tokens=200"):
        cached(cfg, tok).load_state_dict(ld.state_dict())
    cfg.train.unit_tokens, cfg.train.tokens_per_step = 200, 1000
    cached(cfg, tok).load_state_dict(ld.state_dict())


def test_a_corpus_moved_elsewhere_resumes_and_changed_text_is_refused(tmp_path, corpus, tok):
    """A job that stages its data under another path (a node's local disk) resumes: the
    position names the cache by its tokens, not by where the corpus lay."""
    cfg = s2s(tmp_path / "a", corpus / "train")
    ref = take(iter(cached(cfg, tok)), 12)
    ld = cached(cfg, tok)
    take(iter(ld), 8)
    state = roundtrip(ld.state_dict())
    moved = tmp_path / "staged"
    moved.mkdir()
    for side in ("en", "de"):
        (moved / f"train.{side}").write_bytes((corpus / f"train.{side}").read_bytes())
    fresh = cached(s2s(tmp_path / "b", moved / "train"), tok)
    fresh.load_state_dict(state)
    assert all(same(x, y) for x, y in zip(take(iter(fresh), 4), ref[8:12], strict=True))

    text = (moved / "train.de").read_text().splitlines()
    (moved / "train.de").write_text("\n".join(["ein anderer satz", *text[1:]]) + "\n")
    with pytest.raises(DataError, match="cache: checkpoint"):
        cached(s2s(tmp_path / "c", moved / "train"), tok).load_state_dict(state)


# ---- a cache you can trust -------------------------------------------------------------


def test_a_second_open_reads_the_cache_and_a_rebuild_gives_the_same_bytes(tmp_path, corpus, tok):
    cfg = s2s(tmp_path, corpus / "train")
    root = ensure_cache(cfg, "train", tok).root
    assert root == cache_dir(cfg, "train") and not root.with_name("train.partial").exists()
    first = cache_bytes(root)
    manifest = json.loads(first[MANIFEST])
    assert manifest["counts"]["examples"] == 300
    assert manifest["fingerprint"]["tokenizer_sha256"] == tok.sha256
    src_file = manifest["fingerprint"]["files"][0]
    assert src_file["path"].endswith("train.en") and len(src_file["sha256"]) == 64
    before = os.stat(root / "src_tokens.npy").st_mtime_ns
    ensure_cache(cfg, "train", tok)
    assert os.stat(root / "src_tokens.npy").st_mtime_ns == before  # opened, not rebuilt
    ensure_cache(cfg, "train", tok, rebuild=True)
    assert cache_bytes(root) == first


def test_a_cache_of_another_tokenizer_is_refused_by_field(tmp_path, corpus, tok):
    cfg = s2s(tmp_path, corpus / "train")
    ensure_cache(cfg, "train", tok)
    other = train_tokenizer(
        TokenizerConfig(vocab_size=100), lines(corpus / "train.en"), tmp_path / "other.model"
    )
    with pytest.raises(DataError) as err:
        ensure_cache(cfg, "train", other)
    msg = str(err.value)
    assert f"tokenizer_sha256: cache {tok.sha256!r}, now {other.sha256!r}" in msg
    assert "vocab_size: cache 150, now 100" in msg and "--force" in msg


def test_a_changed_source_file_is_named(tmp_path, corpus, tok):
    for side in ("en", "de"):
        (tmp_path / f"c.{side}").write_text((corpus / f"train.{side}").read_text())
    cfg = s2s(tmp_path, tmp_path / "c")
    ensure_cache(cfg, "train", tok)
    os.utime(tmp_path / "c.de", ns=(1, 1))  # touched: same bytes, same content
    ensure_cache(cfg, "train", tok)
    text = (tmp_path / "c.de").read_text()
    (tmp_path / "c.de").write_text(text.replace("eins", "zwei", 1))
    with pytest.raises(DataError, match=r"c\.de: its content changed since the cache was built"):
        ensure_cache(cfg, "train", tok)
    (tmp_path / "c.en").write_text((tmp_path / "c.en").read_text() + "one\n")
    (tmp_path / "c.de").write_text(text + "eins\n")
    with pytest.raises(DataError, match=r"c\.en: cache \d+ bytes, now \d+ bytes"):
        ensure_cache(cfg, "train", tok)


def test_a_touched_corpus_file_is_hashed_once_and_its_new_time_recorded(tmp_path, corpus, tok):
    """A corpus file with a new modification time and the same content costs one hash: the
    open that hashes it records the new time, and the next open hashes the cache alone."""
    from aiayn.runtime.durable import bytes_hashed

    for side in ("en", "de"):
        (tmp_path / f"c.{side}").write_text((corpus / f"train.{side}").read_text())
    cfg = s2s(tmp_path, tmp_path / "c")
    manifest = ensure_cache(cfg, "train", tok).manifest
    arrays = sum(f["bytes"] for f in {**manifest["files"], **manifest["lengths"]}.values())
    os.utime(tmp_path / "c.de", ns=(1, 1))
    for corpus_hashed in ((tmp_path / "c.de").stat().st_size, 0):
        before = bytes_hashed()
        cache = ensure_cache(cfg, "train", tok)
        assert bytes_hashed() - before == arrays + corpus_hashed
    recorded = json.loads((cache.root / MANIFEST).read_text())["fingerprint"]["files"]
    assert [f["mtime_ns"] for f in recorded if f["path"].endswith("c.de")] == [1]


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove", "manifest"])
def test_a_damaged_cache_is_refused_before_any_batch(tmp_path, corpus, tok, damage):
    cfg = s2s(tmp_path, corpus / "train")
    root = ensure_cache(cfg, "train", tok).root
    tokens = root / "tgt_tokens.npy"
    data = bytearray(tokens.read_bytes())
    if damage == "truncate":
        tokens.write_bytes(data[:-64])
        expected = r"tgt_tokens\.npy is \d+ bytes, the manifest says \d+ bytes"
    elif damage == "flip":
        data[-3] ^= 0x01
        tokens.write_bytes(bytes(data))
        expected = r"tgt_tokens\.npy: its sha256 is not the manifest's"
    elif damage == "remove":
        tokens.unlink()
        expected = r"tgt_tokens\.npy is missing"
    else:
        (root / MANIFEST).write_text('{"version": 1, "finger')
        expected = "has no readable manifest"
    with pytest.raises(DataError, match=expected) as err:
        cached(cfg, tok)
    assert "--force" in str(err.value)


def test_a_partial_build_is_never_read_and_a_torn_part_is_redone(tmp_path, corpus, tok):
    cfg = s2s(tmp_path, corpus / "train")
    root = ensure_cache(cfg, "train", tok).root
    reference = cache_bytes(root)
    (root / MANIFEST).unlink()  # as if killed before the manifest was written
    work = root.with_name("train.partial")
    work.mkdir()
    (work / "part_00000000.npz").write_bytes(b"torn")  # a part that was never finished
    ld = cached(cfg, tok)  # rebuilds: no manifest, so the arrays there are not trusted
    assert cache_bytes(root) == reference and not work.exists()
    assert sum(b.size for b in itertools.islice(iter(ld), 5)) > 0


def test_a_build_split_by_file_resumes_an_unfinished_shard_and_equals_one_reader(
    tmp_path, corpus, tok
):
    """Ranks run one after the other here (their shards need no collective): 3 ranks over 4
    file pairs, rank 1 interrupted inside its shard; the next build redoes that shard only,
    and the merge writes what one rank reading the whole stream writes."""
    from aiayn.data.cache import fingerprint
    from aiayn.data.cache.build import _start_build
    from aiayn.data.cache.shares import build_parts, open_share

    split = tmp_path / "split"
    split.mkdir()
    for lang in ("en", "de"):
        rows = (corpus / f"train.{lang}").read_text().splitlines(keepends=True)
        for i in range(4):
            (split / f"part{i}.{lang}").write_text("".join(rows[i::4]))
    one = ensure_cache(s2s(tmp_path / "one", split / "part*"), "train", tok)
    cfg = s2s(tmp_path / "three", split / "part*")
    root = cache_dir(cfg, "train")
    work = root.with_name("train.partial")
    shares = [open_share(cfg, "train", r, 3) for r in range(3)]
    _start_build(cfg, "train", tok, root, work, False, shares[0])
    built = [build_parts(cfg, tok, share, work) for share in shares]
    assert [b["read"] for b in built] == [
        sum(len((split / f"part{i}.en").read_text().splitlines()) for i in shards)
        for shards in ([0, 3], [1], [2])
    ]
    (work / "shard_000001.json").unlink()  # rank 1 killed before its shard's note
    (work / "shard_000001_part_00000000.npz").write_bytes(b"torn")
    again = [build_parts(cfg, tok, share, work) for share in shares]
    assert [b["read"] for b in again] == [0, built[1]["read"], 0]  # only the unfinished one
    merged = merge_on_threads(work, root, again, fingerprint(cfg, "train", tok), cfg, 3)
    assert cache_bytes(root) == cache_bytes(one.root) and not work.exists()
    # Each rank wrote the shards it tokenised: 0 and 3, 1, 2 of the 4.
    assert merged["written"] == [
        pytest.approx(merged["bytes"] * k / 4, rel=0.25) for k in (2, 1, 1)
    ]


def test_a_cache_folder_that_cannot_be_written_fails_saying_what_to_do(tmp_path, corpus, tok):
    """Storage that fails in the merge (here the cache's folder is a file) is a DataError on
    every rank, naming the folder and the fix, and the tokenised parts are kept for the next
    try."""
    cfg = s2s(tmp_path, corpus / "train")
    root = cache_dir(cfg, "train")
    root.parent.mkdir(parents=True)
    root.write_text("not a folder")
    with pytest.raises(DataError, match=r"writing the token cache .*train failed: .*cache_dir"):
        ensure_cache(cfg, "train", tok)
    assert list(root.with_name("train.partial").glob("part_*.npz"))
    root.unlink()
    assert len(ensure_cache(cfg, "train", tok)) == 300


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int32, np.int64])
def test_the_header_every_rank_computes_is_the_one_numpy_writes(tmp_path, dtype):
    """Each rank writes its slices after the .npy header without reading the file: the header
    it computes must be the one np.lib.format.open_memmap wrote before the merge was shared."""
    from aiayn.data.cache.placed import Output

    for n in (0, 1, 1000, 10**8):  # the shape's digits change the header's padding
        path = tmp_path / f"{n}.npy"
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(n,))  # sparse
        offset = arr.offset
        del arr
        with open(path, "rb") as fh:
            assert fh.read(offset) == Output("x", np.dtype(dtype), n).header
        path.unlink()


def merge_on_threads(work: Path, root: Path, built: list, expected: dict, cfg, world: int):
    """merge as `world` ranks run it, one thread each, their steps gathered through a barrier
    as the ranks' collective gathers them. Returns rank 0's account of who wrote and hashed."""
    from aiayn.data.cache.merge import merge

    barrier, slots, results = threading.Barrier(world, timeout=60), [None] * world, [None] * world

    def rank(r: int) -> None:
        def together(step):
            slots[r] = step()
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        results[r] = merge(work, root, built, expected, cfg, r, world, together)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == results[0] for r in results)  # every rank saw the same gathers
    return results[0]


def _build_by_turns(
    cfg: Config, tok, world: int, interrupt: int | None = None
) -> tuple[list[dict], dict]:
    """Ranks of a build over a source cut in byte ranges, run one after the other (the scans
    are gathered between, as ensure_cache's collective does); `interrupt` loses that piece's
    note and tears its part, then builds again; the merge on a thread per rank. Returns each
    rank's last build and the merge's account."""
    from aiayn.data.cache import fingerprint
    from aiayn.data.cache.build import _start_build
    from aiayn.data.cache.shares import build_parts, gather_scans, open_share, scan_ranges

    root = cache_dir(cfg, "train")
    work = root.with_name("train.partial")
    shares = [open_share(cfg, "train", r, world) for r in range(world)]
    assert len(shares[0].pieces) >= world
    for again in range(1 + (interrupt is not None)):
        _start_build(cfg, "train", tok, root, work, False, shares[0])
        scans = gather_scans([scan_ranges(share, work) for share in shares])
        for share in shares:
            share.scans = scans
        built = [build_parts(cfg, tok, share, work) for share in shares]
        if again == 0 and interrupt is not None:
            (work / f"shard_{interrupt:06d}.json").unlink()
            (work / f"shard_{interrupt:06d}_part_00000000.npz").write_bytes(b"torn")
    merged = merge_on_threads(work, root, built, fingerprint(cfg, "train", tok), cfg, world)
    return built, merged


def arrays(root: Path) -> dict[str, bytes]:
    return {k: v for k, v in cache_bytes(root).items() if k != MANIFEST}


def test_one_file_pair_shared_by_byte_range_reads_a_share_per_rank_and_equals_one_reader(
    tmp_path, corpus, tok
):
    """Fewer files than ranks: one pair is cut in 3 byte ranges per side (the target's cuts
    fall on other lines); each rank reads about a third, the arrays equal one reader's, an
    interrupted piece is redone alone, and the manifest's range hashes cover each file."""
    one = ensure_cache(s2s(tmp_path / "one", corpus / "train"), "train", tok)
    cfg = s2s(tmp_path / "three", corpus / "train")
    built, merged = _build_by_turns(cfg, tok, 3, interrupt=1)
    total = one.counts()["records_read"]
    assert [b["read"] for b in built] == [0, pytest.approx(total / 3, rel=0.2), 0]
    three = cache_dir(cfg, "train")
    assert arrays(three) == arrays(one.root)
    # Each rank wrote its own third of the arrays, and hashed about a third of the files
    # (ranges of at least 1 MiB: here each array is one, dealt out largest first).
    assert merged["bytes"] == sum((three / n).stat().st_size for n in arrays(three))
    assert merged["written"] == [pytest.approx(merged["bytes"] / 3, rel=0.25)] * 3
    assert sum(merged["hashed"]) == merged["bytes"] and max(merged["hashed"]) < merged["bytes"] / 2
    manifest = json.loads((three / MANIFEST).read_text())
    assert manifest["counts"] == one.counts()
    for entry in manifest["fingerprint"]["files"]:
        ranges = entry["sha256_ranges"]
        assert entry["sha256"] is None and len(ranges) == 3
        assert [r[0] for r in ranges[1:]] == [r[1] for r in ranges[:-1]]  # they tile the file
        assert (ranges[0][0], ranges[-1][1]) == (0, entry["bytes"])


def test_a_cut_file_touched_is_accepted_and_changed_in_place_is_refused(tmp_path, corpus, tok):
    """The range hashes do what the whole file's did: a new modification time alone is no
    change; one byte changed (same size) is."""
    data = tmp_path / "data"
    data.mkdir()
    for lang in ("en", "de"):
        (data / f"train.{lang}").write_bytes((corpus / f"train.{lang}").read_bytes())
    cfg = s2s(tmp_path / "run", data / "train")
    _build_by_turns(cfg, tok, 2)
    os.utime(data / "train.de", ns=(1, 1))
    ensure_cache(cfg, "train", tok)  # accepted: same bytes
    raw = bytearray((data / "train.de").read_bytes())
    raw[-2] = ord("x") if raw[-2] != ord("x") else ord("y")
    (data / "train.de").write_bytes(bytes(raw))
    os.utime(data / "train.de", ns=(2, 2))
    with pytest.raises(DataError, match="train.de: its content changed"):
        ensure_cache(cfg, "train", tok)


@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_byte_ranges_skip_and_refuse_what_one_reader_does(tmp_path, corpus, lm_corpus, tok, kind):
    """CRLF line ends, empty lines and lines that are not UTF-8, at every place a cut may fall:
    skipped as one reader skips them (same arrays and counts), and with on_invalid_utf8=error
    refused naming the file and the line's number in the whole file."""
    data = tmp_path / "data"
    data.mkdir()
    names = ("train.en", "train.de") if kind == "seq2seq" else ("train.txt",)
    source = corpus if kind == "seq2seq" else lm_corpus
    for name in names:
        rows = (source / name).read_bytes().split(b"\n")[:-1]
        rows[5] = b"\xff\xfe not utf-8" if name != "train.de" else rows[5]
        rows[7] = rows[7] + b"\r"
        rows[9] = b""
        (data / name).write_bytes(b"\n".join(rows) + b"\n")

    def config(run: str, **extra):
        if kind == "seq2seq":
            return s2s(tmp_path / run, data / "train", **extra)
        return lm(tmp_path / run, data, **extra)

    one = ensure_cache(config("one"), "train", tok)
    assert one.counts()["invalid_utf8_skipped"] == 1
    for world in (2, 5):
        cfg = config(f"w{world}")
        _build_by_turns(cfg, tok, world)
        assert arrays(cache_dir(cfg, "train")) == arrays(one.root)
        assert json.loads((cache_dir(cfg, "train") / MANIFEST).read_text())["counts"] == (
            one.counts()
        )
    with pytest.raises(DataError, match=rf"{names[0]} line 6 is not valid UTF-8"):
        _build_by_turns(config("strict", on_invalid_utf8="error"), tok, 3)


def test_a_cut_pair_of_unequal_line_counts_is_refused_naming_both(tmp_path, corpus, tok):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.en").write_bytes((corpus / "train.en").read_bytes())
    (data / "train.de").write_bytes(b"".join((corpus / "train.de").open("rb").readlines()[:-3]))
    with pytest.raises(DataError, match=r"not line-aligned: .*train.en has 300 lines but "):
        _build_by_turns(s2s(tmp_path / "run", data / "train"), tok, 2)


def test_a_node_local_cache_dir_names_its_variable_and_nodes_must_agree(
    tmp_path, corpus, tok, monkeypatch
):
    """data.cache_dir expands this node's variables (an unset one is named); cache_scope=node
    needs a cache_dir; a node whose copy holds other tokens than rank 0's stops every rank."""
    from aiayn.config import load_config
    from aiayn.data.prepare import _same_tokens_on_every_node
    from aiayn.errors import ConfigError

    monkeypatch.setenv("NODE_DISK", str(tmp_path / "disk"))
    cfg = s2s(tmp_path / "run", corpus / "train", cache_dir="$NODE_DISK/cache")
    assert cache_dir(cfg, "train") == tmp_path / "disk" / "cache" / "train"
    monkeypatch.delenv("NODE_DISK")
    with pytest.raises(DataError, match=r"cache_dir \$NODE_DISK/cache names an environment"):
        cache_dir(cfg, "train")
    with pytest.raises(ConfigError, match="cache_scope=node keeps a copy .* set data.cache_dir"):
        load_config(None, ["data.train=x", "data.cache_scope=node"])

    class TwoNodes:  # rank 1 of 2, on the node whose copy differs
        def broadcast(self, obj):
            return "rank 0's digest"

        def sum(self, values):
            return [values[0] + 0.0]  # rank 0 agreed with itself

    cache = ensure_cache(s2s(tmp_path / "one", corpus / "train"), "train", tok)
    with pytest.raises(DataError, match=r"1 rank\(s\) hold a token cache .* other tokens"):
        _same_tokens_on_every_node(TwoNodes(), cache)


def test_the_check_hashes_each_file_in_the_read_that_checks_it(tmp_path, corpus, tok, monkeypatch):
    """One read per file for the check and the fingerprint's sha256, compressed files
    included: the sha256 is the file's own (a touched file is then compared with it)."""
    import gzip

    from aiayn.data.cache import merge, shares

    def arrays_only(path, *args):
        assert "data" not in Path(path).parts, f"{path} read again to hash it"
        return sha256_of(path, *args)

    for module in (shares, merge):  # where the build hashes files
        monkeypatch.setattr(module, "sha256_of", arrays_only)

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.en.gz").write_bytes(gzip.compress((corpus / "train.en").read_bytes()))
    (data / "train.de").write_bytes((corpus / "train.de").read_bytes())
    cfg = s2s(tmp_path / "run", data / "train")
    cache = ensure_cache(cfg, "train", tok)
    entries = cache.manifest["fingerprint"]["files"]
    assert [e["sha256"] for e in entries] == [
        sha256_of(data / "train.en.gz"),
        sha256_of(data / "train.de"),
    ]


@pytest.mark.parametrize("kind", ["seq2seq", "classifier", "lm-documents", "lm-stream"])
def test_every_rank_knows_each_rounds_targets_from_the_plan(tmp_path, corpus, lm_corpus, tok, kind):
    """The loop divides the loss by the step's targets on all ranks; the cache's plan gives
    them on every rank without a collective: each batch's round holds the n_tokens of the W
    batches the ranks take together, summed, and the epoch of the round's last one."""
    if kind == "classifier":
        write_classify(tmp_path, n_train=120, n_valid=10, n_test=10)
        cfg = s2s(tmp_path, tmp_path / "train.jsonl", kind="classifier", fmt="jsonl")
    elif kind == "seq2seq":
        cfg = s2s(tmp_path, corpus / "train")
    else:
        cfg = lm(tmp_path, lm_corpus, lm_order=kind.removeprefix("lm-"))
    world = 3
    loaders = [cached(cfg, tok, rank=r, world_size=world) for r in range(world)]
    streams = [ld.taken() for ld in loaders]
    epochs = set()
    for _ in range(40):  # past an epoch boundary: the rounds continue into the next epoch
        taken = [next(it) for it in streams]
        rounds = {(t.round_targets, t.round_epoch) for t in taken}
        assert rounds == {(sum(t.batch.n_tokens for t in taken), max(t.epoch for t in taken))}
        epochs |= {t.epoch for t in taken}
    assert len(epochs) > 1, "no epoch boundary fell in the rounds: the test saw one epoch"


def test_a_step_takes_its_batches_on_any_world_size_up_to_its_micro_batches(tmp_path, corpus, tok):
    """train.tokens_per_step of 8 micro-batches, on 1, 3, 4 and 8 ranks (3 does not divide 8:
    ranks 0 and 1 take 3, rank 2 takes 2): each step's batches on all ranks together are one
    process's, every rank knows the step's targets, and a position saved on 3 ranks resumes on
    4 at the next step."""
    cfg = s2s(tmp_path, corpus / "train")
    cfg.train.tokens_per_step = 8 * cfg.train.max_tokens
    single = take(iter(cached(cfg, tok)), 8 * 10)

    for world in (1, 3, 4, 8):
        ranks = [steps(cached(cfg, tok, rank=r, world_size=world), 6) for r in range(world)]
        for k in range(6):
            mine = [ranks[r][k] for r in range(world)]
            assert [len(m) for m in mine] == [len(range(r, 8, world)) for r in range(world)]
            want = single[8 * k : 8 * k + 8]
            for r, m in enumerate(mine):
                assert all(same(t.batch, b) for t, b in zip(m, want[r::world], strict=True))
            targets = {t.round_targets for m in mine for t in m}
            assert targets == {sum(b.n_tokens for b in want)}, (world, k)
    three = cached(cfg, tok, rank=2, world_size=3)
    steps(three, 5)
    four = cached(cfg, tok, rank=1, world_size=4)
    four.load_state_dict(roundtrip(three.state_dict()))
    (step,) = steps(four, 1)
    assert all(same(t.batch, b) for t, b in zip(step, single[41:48:4], strict=True))


def rows_by_id(batch) -> dict[int, tuple]:
    """Each example of a batch by its id: its tokens on every side, padding dropped."""
    sides = [t for t in (batch.src, batch.tgt_in, batch.tgt_out) if t is not None]
    return {
        int(i): tuple(tuple(t[r][t[r] != PAD_ID].tolist()) for t in sides)
        for r, i in enumerate(batch.ids)
    }


def examples(batches) -> dict[int, tuple]:
    """rows_by_id over several batches."""
    return {i: row for b in batches for i, row in rows_by_id(b).items()}


def padded_width(batch) -> int:
    return max(x.shape[1] for x in (batch.src, batch.tgt_in) if x is not None)


@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_units_fused_into_forwards_train_the_same_examples_on_any_world_size(
    tmp_path, corpus, lm_corpus, tok, kind
):
    """train.unit_tokens: a step of 12 units, fused into forwards of up to 4 units' tokens.
    On 1, 5 and 12 ranks each step trains exactly the examples of the plan's 12 units (as one
    process takes them, a unit a forward), every forward within max_tokens, every rank knows
    the step's targets and the most forwards a rank runs, and one rank alone fuses. A position
    saved on 5 ranks resumes on 3 with another max_tokens at the next step."""
    base = s2s(tmp_path, corpus / "train") if kind == "seq2seq" else lm(tmp_path, lm_corpus)
    unit = base.train.max_tokens // 2

    def config(max_tokens: int) -> Config:
        train = dataclasses.replace(
            base.train, unit_tokens=unit, tokens_per_step=12 * unit, max_tokens=max_tokens
        )
        return dataclasses.replace(base, train=train)

    units = take(iter(cached(config(unit), tok)), 12 * 6)  # one forward a unit: no fusing
    fused, extra = config(4 * unit), int(kind == "lm")  # a block is one token wider than tgt_in
    assert fused.train.fuses() and not config(unit).train.fuses()

    for world in (1, 5, 12):
        ranks = [steps(cached(fused, tok, rank=r, world_size=world), 6) for r in range(world)]
        for k in range(6):
            want = examples(units[12 * k : 12 * k + 12])
            mine = [ranks[r][k] for r in range(world)]
            got = {}
            for t in (t for m in mine for t in m):
                rows, width = t.batch.ids.numel(), padded_width(t.batch)
                assert rows * (width + extra) <= fused.train.max_tokens, (world, k)
                assert not set(got) & set(rows_by_id(t.batch))
                got.update(rows_by_id(t.batch))
            assert got == want, (world, k)
            assert {t.round_targets for m in mine for t in m} == {
                sum(b.n_tokens for b in units[12 * k : 12 * k + 12])
            }
            assert {t.round_forwards for m in mine for t in m} == {max(map(len, mine))}
        if world == 1:
            assert max(len(step) for step in ranks[0]) < 12  # units fused
    # The memory probe tries the widest units fused as a rank would fuse them: as wide as any
    # forward, near the budget, never over it.
    (probe,) = cached(fused, tok).largest_batches()
    width = padded_width(probe) + extra
    assert width >= max(padded_width(t.batch) + extra for step in ranks[0] for t in step)
    assert fused.train.max_tokens / 2 < probe.ids.numel() * width <= fused.train.max_tokens
    five = cached(fused, tok, rank=4, world_size=5)
    steps(five, 3)
    three = [cached(config(2 * unit), tok, rank=r, world_size=3) for r in range(3)]
    for loader in three:
        loader.load_state_dict(roundtrip(five.state_dict()))
    got = examples(t.batch for loader in three for t in steps(loader, 1)[0])
    assert got == examples(units[36:48])


@pytest.mark.parametrize("kind, world", [("seq2seq", 1), ("seq2seq", 3), ("seq2seq", 8), ("lm", 3)])
def test_plans_kept_beside_the_cache_equal_todays_bit_for_bit(
    tmp_path, corpus, lm_corpus, tok, kind, world
):
    """One rank per node makes each epoch's plan, the others memory-map it, and the batches are
    bitwise those of a rank that plans every epoch itself (batch_checks.check_plans_kept)."""
    cfg = s2s(tmp_path, corpus / "train") if kind == "seq2seq" else lm(tmp_path, lm_corpus)
    check_plans_kept(lambda rank, world: cached(cfg, tok, rank=rank, world_size=world), world)


# ---- lengths stored at build; a cache of another format refused ---------------------------


@pytest.mark.parametrize("kind", ["seq2seq", "lm", "classifier"])
def test_lengths_are_stored_at_build_as_the_offsets_differences(
    tmp_path, corpus, lm_corpus, tok, kind
):
    """A start plans from the int32 lengths the build stored (memory-mapped), which are the
    offsets' differences."""
    if kind == "classifier":
        write_classify(tmp_path, n_train=120, n_valid=10, n_test=10)
        cfg = s2s(tmp_path, tmp_path / "train.jsonl", kind="classifier", fmt="jsonl")
    else:
        cfg = s2s(tmp_path, corpus / "train") if kind == "seq2seq" else lm(tmp_path, lm_corpus)
    cache = ensure_cache(cfg, "train", tok)
    sides = ("src", "tgt") if kind == "seq2seq" else ("src",)
    for side in sides:
        stored, offsets = getattr(cache, f"{side}_lengths"), getattr(cache, f"{side}_offsets")
        assert stored.dtype == np.int32 and not stored.flags.writeable  # the map itself
        assert stored.tobytes() == np.diff(offsets).astype(np.int32).tobytes()


def test_a_cache_built_by_another_aiayn_is_refused_with_the_command_that_rebuilds_it(
    tmp_path, corpus, tok
):
    """A cache of another format version, or built before lengths were stored, is never
    read: the error names the version and `aiayn data prepare ... --force`."""
    cfg = s2s(tmp_path, corpus / "train")
    root = ensure_cache(cfg, "train", tok).root
    manifest = json.loads((root / MANIFEST).read_text())
    for older in (
        {**manifest, "version": 0},
        {k: v for k, v in manifest.items() if k != "lengths"},
    ):
        (root / MANIFEST).write_text(json.dumps(older))
        with pytest.raises(DataError, match="built by another aiayn.*aiayn data prepare"):
            open_cache(root, None)


def test_a_large_start_that_prepares_its_data_says_how_to_prepare_first(
    tmp_path, corpus, tok, caplog
):
    """At LARGE_WORLD ranks, a start whose tokenizer rank 0 would train, whose cache the
    ranks would build, or whose Hub split every rank would read whole warns once, naming the
    commands that prepare it first; below it, or with the data prepared, nothing is said."""
    from aiayn.data.prepare import LARGE_WORLD, warn_serial_start

    cfg = s2s(tmp_path, corpus / "train")  # no tokenizer in run_dir, no cache yet
    assert warn_serial_start(cfg, LARGE_WORLD - 1) == []
    with caplog.at_level("WARNING", logger="aiayn"):
        said = warn_serial_start(cfg, LARGE_WORLD)
    assert len(said) == 2 and str(cfg.tokenizer_path) in said[0]
    assert str(cache_dir(cfg, "train")) in said[1] and "ranks build it now" in said[1]
    for command in ("aiayn data prepare", "aiayn tokenizer train", "slurm/prepare.sbatch"):
        assert caplog.text.count(command) == 2, command
    ready = s2s(tmp_path, corpus / "train")
    ready.tokenizer = TokenizerConfig(path=str(tok.path))
    ensure_cache(ready, "train", tok)
    assert warn_serial_start(ready, 1024) == []
    hub = DataConfig(
        format="hub", hub_name="wmt/wmt14", hub_config="de-en", train="train", cache=False
    )
    streamed = Config(run_dir=str(tmp_path), data=hub, tokenizer=ready.tokenizer)
    (said,) = warn_serial_start(streamed, 64)
    assert "copied from the Hub once, then every rank reads and tokenises the whole copy" in said


def test_a_plan_folder_that_cannot_be_written_leaves_each_rank_planning_for_itself(
    tmp_path, corpus, tok, caplog
):
    cfg = s2s(tmp_path, corpus / "train")
    one = cached(cfg, tok)
    ref = take(iter(one), 40)
    for _ in range(2):  # its plan ahead, then the write it queued: done before the folder goes
        one.rows._planner.submit(int).result()
    root = cache_dir(cfg, "train")
    blocked = root.parent / f"{root.name}.plans"
    shutil.rmtree(blocked)  # the plans the reference run kept
    blocked.write_text("not a folder")  # so no plan can be written under it
    with caplog.at_level("WARNING", logger="aiayn"):
        ranks = [cached(cfg, tok, rank=r, world_size=2) for r in range(2)]
        got = [b for pair in zip(*(take(iter(ld), 20) for ld in ranks), strict=True) for b in pair]
        for ld in ranks:  # the writes are queued behind the plans ahead, on the plan thread
            ld.rows._planner.submit(int).result()
            ld.rows._planner.submit(int).result()
    assert all(same(x, y) for x, y in zip(got, ref, strict=True))
    assert caplog.text.count("cannot keep the epoch's plan") == 1  # from local rank 0 only
