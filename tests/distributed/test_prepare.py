"""`aiayn data prepare` in real processes: two ranks under torchrun cut one file pair in byte
ranges and write the same arrays as one process; four ranks over a corpus of five files each
read only their files, and write the same bytes again; either way each rank writes its own parts
into the arrays and hashes its share of them, rank 0 no more than its share; a SIGKILL at any
moment leaves nothing that is read, and the same command then completes."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiayn.corpora import demo
from aiayn.data.cache import MANIFEST
from aiayn.data.cache.shares import _CHUNK

import helpers  # tests/helpers.py
import procs  # tests/distributed/procs.py, beside this file
from processes import kill_tree, wait_until  # tests/processes.py

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def big(tmp_path_factory, setup) -> tuple[Path, Path]:
    """A corpus of several cache chunks, so that both ranks tokenise, and its config."""
    root, config = setup
    corpus = demo.write_numbers(
        tmp_path_factory.mktemp("big"), n_train=int(2.5 * _CHUNK), n_valid=10, n_test=10
    )
    return corpus, config


def prepare(
    config: Path, corpus: Path, cache: Path, *launcher: str, split: str = "train"
) -> list[str]:
    cmd = [*launcher] if launcher else [sys.executable]
    return cmd + [
        "-m",
        "aiayn",
        "data",
        "prepare",
        "--config",
        str(config),
        f"data.train={corpus}/{split}",
        f"data.cache_dir={cache}",
    ]


@pytest.fixture(scope="module")
def five_files(big) -> Path:
    """The big corpus cut into five file pairs, which the prefix part* reads in order."""
    corpus, _ = big
    for lang in ("en", "de"):
        lines = (corpus / f"train.{lang}").read_text().splitlines(keepends=True)
        size = -(-len(lines) // 5)
        for i in range(5):
            (corpus / f"part{i}.{lang}").write_text("".join(lines[i * size : (i + 1) * size]))
    return corpus


def most_read(out: str) -> int:
    return int(re.search(r"the busiest reading (\d+) records", out).group(1))


MERGED = re.compile(
    r"merged at known offsets: rank 0 wrote (\d+) and hashed (\d+) of the (\d+) bytes"
)


def merged(out: str) -> tuple[int, int, int]:
    """What rank 0 wrote and hashed of the arrays' bytes, and those bytes."""
    wrote, hashed, total = map(int, MERGED.search(out).groups())
    return wrote, hashed, total


def largest_range(root: Path) -> int:
    """The largest piece of an array a rank hashes whole: the share's slack."""
    manifest = json.loads((root / MANIFEST).read_text())
    entries = {**manifest["files"], **manifest["lengths"]}
    return max(b - a for e in entries.values() for a, b, _ in e["sha256_ranges"])


def files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_two_ranks_cut_one_file_pair_in_byte_ranges_and_build_the_same_arrays(big, tmp_path):
    """One file pair, two ranks: each reads about half of each file (byte ranges), and the
    arrays and counts are one process's; the manifest records each range's sha256 where one
    process recorded the files'."""
    corpus, config = big
    out = procs.run(prepare(config, corpus, tmp_path / "one"))
    assert '"examples": ' in out
    two_out = procs.run(prepare(config, corpus, tmp_path / "two", *helpers.torchrun(2)))
    total = len((corpus / "train.en").read_text().splitlines())
    assert most_read(out) == total
    assert most_read(two_out) < 0.6 * total
    one, two = files(tmp_path / "one" / "train"), files(tmp_path / "two" / "train")
    assert set(one) == {
        MANIFEST,
        "ids.npy",
        "src_lengths.npy",
        "src_offsets.npy",
        "src_tokens.npy",
        "tgt_lengths.npy",
        "tgt_offsets.npy",
        "tgt_tokens.npy",
    }
    # One process wrote and hashed it all (the headers and first offsets are rank 0's, apart);
    # of two, rank 0 wrote its byte range's parts and hashed about half of the arrays.
    wrote, hashed, total = merged(out)
    assert hashed == total and total - 2048 < wrote < total
    wrote, hashed, total = merged(two_out)
    assert total == sum(len(b) for b in two.values()) - len(two[MANIFEST])
    assert 0.4 * total < wrote < 0.6 * total
    assert hashed <= total / 2 + largest_range(tmp_path / "two" / "train")
    manifests = [json.loads(m.pop(MANIFEST)) for m in (one, two)]
    assert one == two
    assert manifests[0]["counts"] == manifests[1]["counts"]
    assert manifests[0]["files"] == manifests[1]["files"]
    assert [len(f["sha256_ranges"]) for f in manifests[1]["fingerprint"]["files"]] == [2, 2]
    assert not (tmp_path / "two" / "train.partial").exists()


def test_four_ranks_read_a_fifth_or_two_of_five_files_and_build_the_same_bytes(
    five_files, big, tmp_path
):
    """Split by file, each rank reads its files only (2 of 5 at most, where one rank reading
    the whole stream read all 5), and the cache is the same, ids and counts included."""
    _, config = big
    one = procs.run(prepare(config, five_files, tmp_path / "one", split="part*"))
    four = procs.run(
        prepare(config, five_files, tmp_path / "four", *helpers.torchrun(4), split="part*"),
        timeout=900,
    )
    total = len((five_files / "train.en").read_text().splitlines())
    assert most_read(one) == total
    assert most_read(four) <= 2 * -(-total // 5)  # ranks 0 has files 0 and 4
    assert files(tmp_path / "one" / "train") == files(tmp_path / "four" / "train")
    # Rank 0 wrote the parts of the files it read (2 of 5), and hashed its quarter of the arrays.
    wrote, hashed, size = merged(four)
    assert 0.3 * size < wrote < 0.45 * size
    assert hashed <= size / 4 + largest_range(tmp_path / "four" / "train")
    assert not (tmp_path / "four" / "train.partial").exists()


def test_a_prepare_killed_at_random_moments_leaves_nothing_read_then_completes(big, tmp_path):
    corpus, config = big
    reference = tmp_path / "reference"
    procs.run(prepare(config, corpus, reference))
    cache = tmp_path / "killed"
    root, work = cache / "train", cache / "train.partial"
    rng, interrupted = random.Random(7), 0
    for _ in range(4):
        proc = subprocess.Popen(
            prepare(config, corpus, cache),
            env=procs.ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # The build starts once the interpreter has imported everything.
        wait_until(proc, work.exists, 120, "cache build")
        time.sleep(rng.uniform(0.0, 1.2))  # the build takes about a second here
        kill_tree(proc)
        if (root / MANIFEST).exists():  # it finished first: what it wrote must be whole
            assert files(root) == files(reference / "train")
            shutil.rmtree(cache)
        else:
            interrupted += work.exists()
    assert interrupted, "no kill fell inside a build: the test did not test anything"
    procs.run(prepare(config, corpus, cache))
    assert files(root) == files(reference / "train") and not work.exists()


def test_two_ranks_copy_a_hub_split_once_each_its_files_and_the_cache_is_built_from_the_copy(
    big, tmp_path
):
    """A Hub-layout folder of two data files, two ranks: each rank copies one file, every
    record read once, into local parquet parts; the ranks build the cache from the parts. Then,
    the Hub folder gone and HF_HUB_OFFLINE=1, one process rebuilds the cache (--force) from the
    copy alone, byte for byte (that the copy gives the Hub stream's cache: test_hub_copy.py)."""
    corpus, config = big
    hub = helpers.hub_dataset(tmp_path / "hub", corpus, train_files=2)
    fields = ("data.format=hub", f"data.hub_name={hub}", "data.hub_config=de-en",
              "data.valid=validation", "data.src_field=translation.en",
              "data.tgt_field=translation.de")  # fmt: skip
    cache = tmp_path / "cache"
    procs.run([*prepare(config, corpus, cache, *helpers.torchrun(2)), *fields, "data.train=train"])
    (copy,) = (cache / "hub").glob("*@unpinned/de-en/train")  # a local folder has no revision
    manifest = json.loads((copy / "manifest.json").read_text())
    total = len((corpus / "train.en").read_text().splitlines())
    assert manifest["rows"] == total and manifest["hub_files"] == 2
    by_rank = {r: sum(p["rows"] for p in manifest["parts"] if p["rank"] == r) for r in (0, 1)}
    assert by_rank == {0: -(-total // 2), 1: total // 2}  # each rank read its Hub file only
    built = files(cache / "train")

    shutil.rmtree(hub)
    again = [*prepare(config, corpus, cache), *fields, "data.train=train", "--force"]
    env = {**procs.ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(again, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rebuilt = files(cache / "train")
    assert built.pop(MANIFEST) and rebuilt.pop(MANIFEST) and built == rebuilt
