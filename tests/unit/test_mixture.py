"""A mixture of sources (data.sources): the counts each epoch takes, which examples, the
batches at any world size, resume, tags, and what a changed mixture or tokenizer is told."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from batch_checks import check_plans_kept, roundtrip, same, take

from aiayn.config import Config, DataConfig, ModelConfig, SourceConfig, TokenizerConfig, TrainConfig
from aiayn.corpora.demo import write_numbers
from aiayn.data import Loader, ensure_cache, make_loader
from aiayn.data.batch import target_positions
from aiayn.data.cache import cache_dir
from aiayn.data.cache_rows import CacheRows
from aiayn.data.mixture import (
    Mixture,
    as_train,
    cache_folder,
    epoch_counts,
    largest_remainder,
    pass_order,
    shares,
    tokenizer_sample,
)
from aiayn.data.mixture import (
    take as take_items,
)
from aiayn.data.plan import epoch_rng, pair_plan
from aiayn.data.stream_mixture import StreamMixture
from aiayn.errors import DataError
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_tokenizer

SIZES = (300, 120, 40)  # the three corpora's training pairs
TAG = "<bt>"

# ---- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("mix")
    return [
        write_numbers(root / f"c{i}", n_train=n, n_valid=6, n_test=2, seed=i + 1) / "train"
        for i, n in enumerate(SIZES)
    ]


@pytest.fixture(scope="module")
def mtok(corpora, tmp_path_factory):
    sents = [
        line
        for prefix in corpora
        for side in ("en", "de")
        for line in Path(f"{prefix}.{side}").read_text().splitlines()
    ]
    out = tmp_path_factory.mktemp("mtok") / "spm.model"
    return train_tokenizer(TokenizerConfig(vocab_size=150, user_symbols=[TAG]), sents, out)


def mixed_cfg(run_dir: Path, corpora, weights=(2, 1, 1), tag=TAG, **data) -> Config:
    names = ("a", "b", "c")
    sources = [
        SourceConfig(name=n, path=str(p), weight=w, tag=tag if n == "b" else None)
        for n, p, w in zip(names, corpora, weights, strict=True)
    ]
    data = {"shuffle_buffer": 64, "max_len": 64, "cache_dir": str(run_dir.parent / "cache"), **data}
    return Config(
        run_dir=str(run_dir),
        model=ModelConfig(max_len=128),
        data=DataConfig(sources=sources, src_lang="en", tgt_lang="de", **data),
        train=TrainConfig(max_tokens=200, seed=3),
    )


def mixed(cfg: Config, tok, rank=0, world_size=1) -> Loader:
    caches = [
        ensure_cache(as_train(cfg, s), "train", tok, folder=cache_folder(s))
        for s in cfg.data.sources
    ]
    return make_loader(cfg, None, tok, train=True, rank=rank, world_size=world_size, cache=caches)


def pairs(batch) -> list[tuple[int, int]]:
    """(source, example) of each row: what identifies an example of a mixture."""
    return list(zip(batch.sources.tolist(), batch.ids.tolist(), strict=True))


# ---- the counts --------------------------------------------------------------------------


def assert_resumes(make, cfg, mtok, single, world: int, after: int, cut: int) -> None:
    """A loader of `world` ranks that took `cut` batches (rounded down to whole rounds), saved
    and resumed on `after` ranks, gives round by round the batches `single` (one rank,
    uninterrupted) has next."""
    cut -= cut % world  # the group consumes whole rounds
    before = make(cfg, mtok, world - 1, world)
    take(iter(before), cut // world)
    state = roundtrip(before.state_dict())
    ranks = [make(cfg, mtok, r, after) for r in range(after)]
    for r in ranks:
        r.load_state_dict(state)
    per_rank = [take(iter(r), 4) for r in ranks]
    got = [b for group in zip(*per_rank, strict=True) for b in group]
    want = single[cut : cut + 4 * after]
    assert all(pairs(x) == pairs(y) and same(x, y) for x, y in zip(got, want, strict=True))


def test_largest_remainder_gives_the_shares_in_integers_and_ties_to_the_earlier_source():
    assert largest_remainder(np.array([0.5, 0.3, 0.2]), 7).tolist() == [4, 2, 1]  # 3.5 2.1 1.4
    assert largest_remainder(np.array([0.5, 0.5]), 3).tolist() == [2, 1]
    p = shares(np.array(SIZES), [2, 1, 1], None)
    for total in (1, 10, 459, 460, 10_001):
        counts = largest_remainder(p, total)
        assert counts.sum() == total and np.all(np.abs(counts - p * total) < 1)


def test_a_temperature_shares_by_size_to_the_power_one_over_t():
    sizes = np.array(SIZES)
    assert shares(sizes, None, 1.0) == pytest.approx([300 / 460, 120 / 460, 40 / 460])
    root = np.sqrt(sizes)
    assert shares(sizes, None, 2.0) == pytest.approx(root / root.sum())  # flatter: c up-sampled


@pytest.mark.parametrize(
    "definition, extra, counts",
    [
        ("sum", {}, [230, 115, 115]),  # 460 examples, as all sources hold
        ("largest", {}, [300, 150, 150]),  # one pass of a (300), a half of the epoch
        ("source", {"source": "c"}, [80, 40, 40]),  # c: its 40 are a quarter of 160
        ("source", {"source": "b"}, [240, 120, 120]),
        ("examples", {"size": 1001}, [501, 250, 250]),
        ("tokens", {"size": 1000, "mean_tokens": np.array([10.0, 5.0, 5.0])}, [67, 33, 33]),
    ],
)
def test_each_epoch_definition_gives_its_size(definition, extra, counts):
    p = shares(np.array(SIZES), [2, 1, 1], None)
    got = epoch_counts(np.array(SIZES), p, definition, names=["a", "b", "c"], **extra)
    assert got.tolist() == counts  # tokens: 1000 / (0.5 * 10 + 0.25 * 5 + 0.25 * 5) = 133


def test_a_pass_is_a_permutation_and_epochs_continue_where_the_last_stopped():
    n, count = 40, 115  # c up-sampled: nearly three passes an epoch
    epochs = [take_items(7, "c", n, e * count, count) for e in range(3)]
    flat = np.concatenate(epochs)
    passes = [flat[q * n : (q + 1) * n] for q in range(len(flat) // n)]
    assert all(sorted(p.tolist()) == list(range(n)) for p in passes)  # nothing repeats in a pass
    assert [p.tolist() for p in passes] == [pass_order(7, "c", n, q).tolist() for q in range(8)]
    assert not np.array_equal(passes[0], passes[1])
    down = [take_items(7, "a", 300, e * 154, 154) for e in range(2)]  # a down-sampled
    assert down[1][:146].tolist() == pass_order(7, "a", 300, 0)[154:].tolist()  # continues
    assert down[1][146:].tolist() == pass_order(7, "a", 300, 1)[:8].tolist()  # then pass 1
    # What a plan is given: the same examples, a whole pass in index order (it permutes them).
    for e in range(3):
        given = take_items(7, "c", n, e * count, count, ordered=False)
        assert sorted(given.tolist()) == sorted(epochs[e].tolist())


# ---- the loader --------------------------------------------------------------------------


def first_epoch(ld) -> list:
    return take(iter(ld), len(ld.rows.plan(0)[0]))


def test_an_epoch_holds_each_sources_count_and_no_example_twice_within_a_pass(
    tmp_path, corpora, mtok
):
    cfg = mixed_cfg(tmp_path / "run", corpora)
    ld = mixed(cfg, mtok)
    assert ld.rows.mixture.counts.tolist() == [230, 115, 115]
    assert ld.rows.mixture.sizes.tolist() == list(SIZES)
    taken = [p for b in first_epoch(ld) for p in pairs(b)]
    per_source = Counter(s for s, _ in taken)
    assert [per_source[s] for s in range(3)] == [230, 115, 115]
    seen = Counter(taken)
    assert max(seen[(0, i)] for i in range(300)) == 1  # a: under one pass, none twice
    assert max(seen[(1, i)] for i in range(120)) == 1  # b: 115 of 120
    assert sorted(seen[(2, i)] for i in range(40)) == [2] * 5 + [3] * 35  # c: 2.875 passes
    assert ld.mixture_scalars()["c/passes"] == pytest.approx(115 / 40)


@pytest.mark.parametrize(
    "epoch, extra, counts",
    [
        ("largest", {}, [300, 150, 150]),
        ("source", {"epoch_source": "c"}, [80, 40, 40]),
        ("examples", {"epoch_size": 101}, [51, 25, 25]),
    ],
)
def test_each_epoch_definition_is_what_the_loaders_epoch_holds(
    tmp_path, corpora, mtok, epoch, extra, counts
):
    ld = mixed(mixed_cfg(tmp_path / "run", corpora, epoch=epoch, **extra), mtok)
    assert ld.rows.mixture.counts.tolist() == counts
    per_source = Counter(s for b in first_epoch(ld) for s in b.sources.tolist())
    assert [per_source[s] for s in range(3)] == counts


def test_an_epoch_of_tokens_holds_about_that_many_target_tokens(tmp_path, corpora, mtok):
    ld = mixed(mixed_cfg(tmp_path / "run", corpora, epoch="tokens", epoch_size=3000), mtok)
    tokens = sum(b.n_tokens for b in first_epoch(ld))  # target tokens, eos included
    assert abs(tokens - 3000) < 0.1 * 3000
    assert (
        ld.rows.mixture.counts.tolist()
        == largest_remainder(ld.rows.mixture.p, ld.rows.mixture.epoch_size).tolist()
    )
    assert ld.rows.mixture.p.tolist() == [0.5, 0.25, 0.25]


def test_rank_r_takes_global_batches_r_r_plus_w_at_every_world_size(tmp_path, corpora, mtok):
    cfg = mixed_cfg(tmp_path / "run", corpora)
    single = take(iter(mixed(cfg, mtok)), 60)  # past an epoch (about 25 batches)
    for world in (2, 3):
        per_rank = [take(iter(mixed(cfg, mtok, r, world)), 60 // world) for r in range(world)]
        rounds = [b for group in zip(*per_rank, strict=True) for b in group]
        assert all(same(x, y) and pairs(x) == pairs(y) for x, y in zip(rounds, single, strict=True))


def test_a_position_resumes_at_another_world_size_across_pass_and_epoch_boundaries(
    tmp_path, corpora, mtok
):
    cfg = mixed_cfg(tmp_path / "run", corpora)
    ld = mixed(cfg, mtok)
    per_epoch = len(ld.rows.plan(0)[0])
    single = take(iter(mixed(cfg, mtok)), 2 * per_epoch + 12)
    for world, after in ((1, 2), (2, 1), (2, 3)):
        for cut in (5, per_epoch - 1, per_epoch + 2):  # mid-epoch, at its end, in the next
            assert_resumes(mixed, cfg, mtok, single, world, after, cut)


def test_the_tag_is_the_first_source_token_and_counts_in_max_len_and_the_budget(
    tmp_path, corpora, mtok
):
    tag = mtok.sp.piece_to_id(TAG)
    cfg = mixed_cfg(tmp_path / "run", corpora)
    ld = mixed(cfg, mtok)
    for b in take(iter(ld), 30):
        tagged = b.sources == 1
        assert (b.src[tagged, 0] == tag).all() and (b.src[~tagged, 0] != tag).all()
        assert b.src.numel() <= cfg.train.max_tokens or len(b.ids) == 1
    # Every b row is one token longer than it would be untagged, in the widths the plan sees.
    c, rows = ld.rows.caches[1], ld.rows
    src_len = np.diff(c.src_offsets)
    assert rows._width[rows.base[1] : rows.base[2]].min() >= src_len.min() + 2  # tag and eos
    # At a max_len the longest b source sentences fit exactly, the tag drops them.
    longest = int(src_len.max())
    tgt_len = np.diff(c.tgt_offsets)
    at = mixed(mixed_cfg(tmp_path / "m", corpora, max_len=longest), mtok)
    untagged = mixed(mixed_cfg(tmp_path / "u", corpora, tag=None, max_len=longest), mtok)
    dropped = int(((src_len == longest) & (tgt_len <= longest)).sum())
    assert dropped >= 1
    assert at.rows.mixture.sizes[1] == untagged.rows.mixture.sizes[1] - dropped


def test_every_row_is_its_sources_pair_tokenised_with_the_tag_eos_and_bos(tmp_path, corpora, mtok):
    texts = [
        [Path(f"{prefix}.{side}").read_text().splitlines() for side in ("en", "de")]
        for prefix in corpora
    ]
    tag = mtok.sp.piece_to_id(TAG)
    ld = mixed(mixed_cfg(tmp_path / "run", corpora), mtok)
    for b in take(iter(ld), 12):
        for row, (s, i) in enumerate(pairs(b)):
            src, tgt = mtok.encode([texts[s][0][i], texts[s][1][i]])
            src = ([tag] if s == 1 else []) + src + [EOS_ID]
            assert b.src[row, : len(src)].tolist() == src
            assert (b.src[row, len(src) :] == PAD_ID).all()
            assert b.tgt_in[row, : len(tgt) + 1].tolist() == [BOS_ID] + tgt
            assert b.tgt_out[row, : len(tgt) + 1].tolist() == tgt + [EOS_ID]
            assert (b.tgt_out[row, len(tgt) + 1 :] == PAD_ID).all()
            assert (b.tgt_in[row, len(tgt) + 1 :] == PAD_ID).all()
        assert b.n_tokens == int((b.tgt_out != PAD_ID).sum()) == len(b.keep)


def test_a_batch_is_as_wide_as_its_widest_row_and_a_target_of_max_len_tokens_fits(
    tmp_path, corpora, mtok
):
    """src: the widest row with its tag and eos; tgt_in and tgt_out: the longest target + 1.
    (The first mixed loader made the targets one column wider than that, which a target of
    data.max_len tokens would have taken past the position table.)"""
    probe = mixed(mixed_cfg(tmp_path / "probe", corpora), mtok)
    # The longest target of a pair whose source (with its tag) is no longer: at that max_len
    # the pair is kept, and its batch's targets are max_len + 1 wide.
    longest = max(
        int(tgt[src <= tgt].max(initial=0))
        for c, lead in zip(probe.rows.caches, [t is not None for t in probe.rows.tags], strict=True)
        for src, tgt in [(np.diff(c.src_offsets) + lead, np.diff(c.tgt_offsets))]
    )
    ld = mixed(mixed_cfg(tmp_path / "run", corpora, max_len=longest), mtok)
    at_max_len = 0
    for b in first_epoch(ld):
        assert b.src.shape[1] == int((b.src != PAD_ID).sum(1).max())
        assert b.tgt_in.shape == b.tgt_out.shape
        assert b.tgt_out.shape[1] == int((b.tgt_out != PAD_ID).sum(1).max()) <= longest + 1
        at_max_len += b.tgt_out.shape[1] == longest + 1
    assert at_max_len >= 1


def loader_of(kind: str, tmp_path: Path, corpora, mtok, rank: int, world: int):
    if kind == "sources":
        return mixed(mixed_cfg(tmp_path / "run", corpora), mtok, rank, world)
    cfg = dataclasses.replace(
        mixed_cfg(tmp_path / "run", corpora),
        data=DataConfig(train=str(corpora[0]), src_lang="en", tgt_lang="de", shuffle_buffer=64),
    )
    cache = ensure_cache(cfg, "train", mtok)
    return make_loader(
        cfg, cfg.data.train, mtok, train=True, rank=rank, world_size=world, cache=cache
    )


@pytest.mark.parametrize("kind", ["train", "sources"])
@pytest.mark.parametrize("count, world", [(2, 1), (5, 3), (64, 2)])
def test_batches_read_together_are_the_batches_read_one_at_a_time(
    tmp_path, corpora, mtok, kind, count, world
):
    """A rank reads and pads its next `count` batches at once (data/pad.py): the
    batches do not depend on how many are read together, each holds its plan rows in the
    plan's order (a mixture's rows are read source by source and put back), and each tensor
    is a contiguous view whose Batch.keep is what target_positions finds."""
    ld = loader_of(kind, tmp_path, corpora, mtok, world - 1, world)
    plan, sums = ld.rows.plan(0)
    segment, mine = ld.rows._segment(0, plan, sums), range(world - 1, len(plan), world)
    alone = [segment.read(np.array([k])).batch(k) for k in mine]
    ld._read_count = count
    together = [ld._batch(segment, k) for k in mine]
    assert all(same(x, y) for x, y in zip(alone, together, strict=True))
    for k, b in zip(mine, together, strict=True):
        rows = plan.batch(k)
        if kind == "sources":
            which = ld.rows._source_of[rows]
            local = rows - ld.rows.base[which]
            caches = ld.rows.caches
            want = [(int(s), int(caches[s].ids[i])) for s, i in zip(which, local, strict=True)]
            assert pairs(b) == want
        else:
            assert b.ids.tolist() == ld.rows.caches[0].ids[rows].tolist() and b.sources is None
        assert all(t.is_contiguous() for t in (b.src, b.tgt_in, b.tgt_out, b.keep))
        assert torch.equal(b.keep, target_positions(b.tgt_out, PAD_ID))
        assert b.n_tokens == len(b.keep)


def test_a_mixtures_plans_kept_beside_its_caches_equal_todays_bit_for_bit(tmp_path, corpora, mtok):
    """A mixture's epochs are planned once per node too, beside its first source's cache, and
    read by the node's other ranks: the batches bitwise those of a rank that plans each epoch."""
    cfg = mixed_cfg(tmp_path / "run", corpora)
    check_plans_kept(lambda rank, world: mixed(cfg, mtok, rank, world), 3)


def test_a_tag_that_is_not_a_piece_is_refused_naming_it_and_the_fix(tmp_path, corpora, tok):
    with pytest.raises(DataError, match=r"tag '<bt>' is not a piece .* tokenizer.user_symbols"):
        mixed(mixed_cfg(tmp_path / "run", corpora), tok)


def test_a_tokenizer_trained_for_a_mixture_holds_every_tag_and_each_sources_text(corpora):
    cfg = mixed_cfg(Path("/nonexistent/run"), corpora)
    tok_cfg, sentences = tokenizer_sample(cfg, 400)
    assert tok_cfg.user_symbols == [TAG]
    assert len(sentences) == 200 + 100 + 80  # sentences by weight; c has 40 pairs, 80
    c_text = set(Path(f"{corpora[2]}.en").read_text().splitlines())
    assert c_text & set(sentences)


def test_one_loader_over_four_row_sources_and_only_a_mixture_has_scalars(tmp_path, corpora, mtok):
    """One Loader over the row sources of two axes (stream or cache, one source or a
    mixture): one rank's round is its own batch, and what the trainer logs under "data" is a
    mixture's alone, a single source's empty."""
    one = Config(
        run_dir=str(tmp_path / "one"),
        model=ModelConfig(max_len=128),
        data=DataConfig(train=str(corpora[0]), src_lang="en", tgt_lang="de", shuffle_buffer=64),
        train=TrainConfig(max_tokens=200, seed=3),
    )
    cache = ensure_cache(one, "train", mtok)
    loaders = {
        "cache": make_loader(one, one.data.train, mtok, train=True, cache=cache),
        "stream": make_loader(one, one.data.train, mtok, train=True),
        "mixed cache": mixed(mixed_cfg(tmp_path / "mix", corpora), mtok),
        "mixed stream": streamed(stream_cfg(tmp_path / "stream", corpora), mtok),
    }
    for name, ld in loaders.items():
        assert type(ld) is Loader and ld.epoch == 0, name
        taken = next(ld.taken())
        assert (taken.round_targets, taken.round_epoch) == (taken.batch.n_tokens, 0), name
        scalars = ld.mixture_scalars()
        if name in ("cache", "stream"):
            assert scalars == {}, name
        else:
            assert sorted(scalars)[:3] == ["a/examples", "a/passes", "a/token_share"], name


def test_data_train_alone_keeps_its_loader_plan_and_cache_folder(tmp_path, corpora, mtok):
    """data.train is what it was: the single-cache loader, its cache in data_cache/train, a
    fingerprint without a mixture, and the plan of the whole-epoch permutation."""
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        model=ModelConfig(max_len=128),
        data=DataConfig(train=str(corpora[0]), src_lang="en", tgt_lang="de", shuffle_buffer=64),
        train=TrainConfig(max_tokens=200, seed=3),
    )
    cache = ensure_cache(cfg, "train", mtok)
    assert cache.root == tmp_path / "run" / "data_cache" / "train" == cache_dir(cfg, "train")
    ld = make_loader(cfg, cfg.data.train, mtok, train=True, cache=cache)
    assert type(ld.rows) is CacheRows and ld.rows.mixture is None
    fp = ld.state_dict()["fingerprint"]
    assert sorted(fp) == sorted(
        [
            "loader",
            "cache",
            "kind",
            "train",
            "max_tokens",
            "seed",
            "shuffle_buffer",
            "max_len",
            "pad_to_multiple",
            "tokenizer_sha256",
        ]
    )
    keep = np.arange(300, dtype=np.int32)
    plan = pair_plan(ld.rows._width, keep, 200, 64, epoch_rng(3, 0))
    assert np.array_equal(ld.rows.plan(0)[0].rows, plan.rows)
    assert np.array_equal(ld.rows.plan(0)[0].order, plan.order)
    assert next(iter(ld)).sources is None


def test_a_changed_mixture_is_refused_at_resume_naming_the_change(tmp_path, corpora, mtok):
    cfg = mixed_cfg(tmp_path / "run", corpora)
    ld = mixed(cfg, mtok)
    take(iter(ld), 3)
    state = roundtrip(ld.state_dict())
    changes = {
        "source a: weight checkpoint 2.0, now 3.0": dict(weights=(3, 1, 1)),
        "source b: tag checkpoint '<bt>', now None": dict(tag=None),
        "data.epoch: checkpoint 'sum', now 'largest'": dict(epoch="largest"),
    }
    for message, change in changes.items():
        with pytest.raises(DataError, match=message.replace("(", r"\(")):
            mixed(mixed_cfg(tmp_path / "run", corpora, **change), mtok).load_state_dict(state)
    fewer = mixed_cfg(tmp_path / "run", corpora)
    fewer.data.sources = fewer.data.sources[:2]
    with pytest.raises(DataError, match="source c: in the checkpoint's mixture, not now"):
        mixed(fewer, mtok).load_state_dict(state)
    swapped = mixed_cfg(tmp_path / "run", corpora)
    swapped.data.sources[2] = dataclasses.replace(swapped.data.sources[2], path=str(corpora[1]))
    swapped.data.cache_dir = str(tmp_path / "other_cache")
    with pytest.raises(DataError, match=r"source c: its tokens changed"):
        mixed(swapped, mtok).load_state_dict(state)
    single = Config(
        run_dir=str(tmp_path / "one"),
        model=ModelConfig(max_len=128),
        data=DataConfig(train=str(corpora[0]), src_lang="en", tgt_lang="de", shuffle_buffer=64),
        train=TrainConfig(max_tokens=200, seed=3),
    )
    one = make_loader(
        single, single.data.train, mtok, train=True, cache=ensure_cache(single, "train", mtok)
    )
    with pytest.raises(DataError, match="trained on data.sources, this config names data.train"):
        one.load_state_dict(state)
    with pytest.raises(DataError, match="trained on data.train, this config names data.sources"):
        mixed(cfg, mtok).load_state_dict(roundtrip(one.state_dict()))


def test_per_source_scalars_follow_the_groups_position(tmp_path, corpora, mtok):
    cfg = mixed_cfg(tmp_path / "run", corpora)
    ld = mixed(cfg, mtok, rank=1, world_size=2)
    got = list(itertools.islice(iter(ld), 5))  # 10 global batches
    single = mixed(cfg, mtok)
    ref = take(iter(single), 10)
    assert Counter(s for b in ref for s in b.sources.tolist()) == Counter(
        {s: int(ld.mixture_scalars()[f"{n}/examples"]) for s, n in enumerate("abc")}
    )
    shares_now = [ld.mixture_scalars()[f"{n}/token_share"] for n in "abc"]
    assert sum(shares_now) == pytest.approx(1.0)
    assert got  # rank 1's own batches are a half of them
    tokens = Counter()
    for b in ref:
        for s, row in zip(b.sources.tolist(), b.tgt_out, strict=True):
            tokens[s] += int((row != 0).sum())
    total = sum(tokens.values())
    assert shares_now == pytest.approx([tokens[s] / total for s in range(3)])
    assert EOS_ID in ref[0].tgt_out[0]


def test_mixture_sizes_count_only_examples_within_max_len(corpora):
    cfg = DataConfig(sources=[SourceConfig(name="x", path="p", weight=1)])
    m = Mixture.of(cfg, 1, [5], [3.0])
    assert m.counts.tolist() == [5] and m.epoch_size == 5
    with pytest.raises(ValueError, match="source.s. y have no example"):
        Mixture.of(
            dataclasses.replace(cfg, sources=[*cfg.sources, SourceConfig("y", "q", 1.0)]),
            1,
            [5, 0],
            [3.0, 3.0],
        )


# ---- streamed (data.cache false) ---------------------------------------------------------


def streamed(cfg: Config, tok, rank=0, world_size=1):
    return make_loader(cfg, None, tok, train=True, rank=rank, world_size=world_size)


def stream_cfg(run_dir: Path, corpora, **data) -> Config:
    data = {"cache": False, "epoch": "examples", "epoch_size": 230, "shuffle_buffer": 64, **data}
    return mixed_cfg(run_dir, corpora, **data)


def test_a_streamed_epoch_reads_each_sources_count_passes_in_order(tmp_path, corpora, mtok):
    ld = streamed(stream_cfg(tmp_path / "run", corpora), mtok)
    assert ld.rows.mixture.counts.tolist() == [115, 58, 57]
    it, epochs = iter(ld), {0: [], 1: []}
    while ld.epoch < 2:
        batch = next(it)
        if ld.epoch < 2:
            epochs[ld.epoch] += pairs(batch)
    first, second = (Counter(epochs[e]) for e in (0, 1))
    assert [sum(1 for s, _ in epochs[0] if s == k) for k in range(3)] == [115, 58, 57]
    # Each source in its own order, from where it stopped: a's first 115 lines, then 115-229.
    assert {i for s, i in first if s == 0} == set(range(115))
    assert {i for s, i in second if s == 0} == set(range(115, 230))
    assert {i for s, i in first if s == 1} == set(range(58))
    # c (40 lines) passes once and then reads 17 lines more: nothing twice within a pass.
    assert sorted(first[(2, i)] for i in range(40)) == [1] * 23 + [2] * 17
    assert ld.mixture_scalars()["c/passes"] == 2  # 114 of c's lines read by epoch 2


def test_streamed_rounds_are_the_same_batches_at_every_world_size(tmp_path, corpora, mtok):
    cfg = stream_cfg(tmp_path / "run", corpora)
    single = take(iter(streamed(cfg, mtok)), 36)  # past two epochs of 230 examples
    for world in (2, 3):
        per_rank = [take(iter(streamed(cfg, mtok, r, world)), 36 // world) for r in range(world)]
        rounds = [b for group in zip(*per_rank, strict=True) for b in group]
        assert all(same(x, y) and pairs(x) == pairs(y) for x, y in zip(rounds, single, strict=True))


def test_a_streamed_position_resumes_at_another_world_size_across_passes_and_epochs(
    tmp_path, corpora, mtok
):
    cfg = stream_cfg(tmp_path / "run", corpora)
    single = take(iter(streamed(cfg, mtok)), 40)
    for world, after in ((1, 2), (2, 1), (3, 2)):
        for cut in (4, 12, 18, 27):  # inside the first chunk, later chunks, the next epochs
            assert_resumes(streamed, cfg, mtok, single, world, after, cut)


def test_a_streamed_tag_is_the_first_source_token_and_a_changed_mixture_is_refused(
    tmp_path, corpora, mtok
):
    tag = mtok.sp.piece_to_id(TAG)
    ld = streamed(stream_cfg(tmp_path / "run", corpora), mtok)
    for b in take(iter(ld), 10):
        tagged = b.sources == 1
        assert (b.src[tagged, 0] == tag).all() and (b.src[~tagged, 0] != tag).all()
    state = roundtrip(ld.state_dict())
    other = streamed(stream_cfg(tmp_path / "run", corpora, weights=(1, 1, 1)), mtok)
    with pytest.raises(DataError, match=r"source a: weight checkpoint 2.0, now 1.0"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="streaming loader's .data.cache=false.: resume with"):
        mixed(mixed_cfg(tmp_path / "run", corpora), mtok).load_state_dict(state)


def test_a_streamed_epoch_by_the_sources_sizes_counts_them_once_per_run(
    tmp_path, corpora, mtok, monkeypatch
):
    cfg = stream_cfg(tmp_path / "run", corpora, epoch="sum", epoch_size=None)
    ld = streamed(cfg, mtok)
    assert ld.rows.mixture.counts is None  # known once the streams are counted, as it starts
    it = iter(ld)
    take(it, 3)
    mixture = ld.rows.mixture
    assert mixture.sizes == list(SIZES) and mixture.counts.tolist() == [230, 115, 115]
    state = roundtrip(ld.state_dict())
    assert state["position"]["sizes"] == list(SIZES)
    ref = take(it, 4)

    def counted_again(self):
        raise AssertionError("a resumed run counted the streams again")

    monkeypatch.setattr(StreamMixture, "_count_sizes", counted_again)
    again = streamed(cfg, mtok)
    again.load_state_dict(state)
    assert all(same(x, y) for x, y in zip(take(iter(again), 4), ref, strict=True))
    by_size = stream_cfg(tmp_path / "t", corpora, weights=(None,) * 3, epoch="sum")
    by_size.data.temperature, by_size.data.epoch_size = 1.0, None  # T = 1: shares by size
    monkeypatch.undo()
    sized = streamed(by_size, mtok)
    take(iter(sized), 1)
    assert sized.rows.mixture.counts.tolist() == list(SIZES)
