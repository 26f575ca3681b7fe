"""`aiayn data download`: every file checked against its recorded sha256 before it takes its final
name, kept when it is already right, and nothing partial left by a bad checksum or a dropped
connection; the recorded checksums are the shared copies'; a recipe finds its corpus in
../shared/data or data/corpora. Served from a local HTTP server or file:// (no network)."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from aiayn.cli import main
from aiayn.corpora.catalog import CORPORA, Corpus, RemoteFile, corpus_dir, missing_corpus_hint
from aiayn.corpora.download import download, stored_sha256
from aiayn.data.source import expand_files
from aiayn.errors import DataError
from aiayn.runtime.durable import size_text

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "launch"))
import stages  # noqa: E402

TEXT = "".join(f"line {i} of the plain upstream file\n" for i in range(2000)).encode()
PACKED = gzip.compress(b"".join(b"line %d of a gzip upstream file\n" % i for i in range(2000)))


def registry(sha_of_text: str | None = None) -> dict[str, Corpus]:
    """A corpus "fake" of two files at example.invalid: one stored as it comes (gzip upstream),
    one plain text gzip-compressed on write, as the real registry has both."""
    files = (
        RemoteFile(
            "train.de.gz",
            "https://example.invalid/x/train.de.gz",
            hashlib.sha256(PACKED).hexdigest(),
            len(PACKED),
        ),
        RemoteFile(
            "wiki.train.tokens.gz",
            "https://example.invalid/x/train.txt",
            sha_of_text or hashlib.sha256(TEXT).hexdigest(),
            len(TEXT),
            gzip=True,
        ),
    )
    return {"fake": Corpus("fake", "a test corpus", "none", files)}


def upstream(folder: Path) -> Path:
    """The mirror layout: MIRROR/CORPUS/<upstream file name>."""
    (folder / "fake").mkdir(parents=True)
    (folder / "fake" / "train.de.gz").write_bytes(PACKED)
    (folder / "fake" / "train.txt").write_bytes(TEXT)
    return folder


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class HalfBody(Quiet):
    """Promises the whole file, sends half of it, and closes the connection."""

    def do_GET(self) -> None:
        body = (Path(self.directory) / self.path.lstrip("/")).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()
        self.close_connection = True


def serve(folder: Path, handler=Quiet):
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(folder))
    )
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def mirror(tmp_path):
    server, url = serve(upstream(tmp_path / "mirror"))
    yield url
    server.shutdown()
    server.server_close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def written_right(dest: Path) -> bool:
    return (dest / "train.de.gz").read_bytes() == PACKED and gzip.decompress(
        (dest / "wiki.train.tokens.gz").read_bytes()
    ) == TEXT


def test_a_download_checks_every_file_and_a_second_run_keeps_them_without_the_network(
    tmp_path, mirror, capsys
):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / ".train.de.gz.part").write_bytes(b"what a killed run left")
    download("fake", dest, mirror=mirror, corpora=registry())
    assert written_right(dest)
    assert sorted(p.name for p in dest.iterdir()) == ["train.de.gz", "wiki.train.tokens.gz"]
    out = capsys.readouterr().out
    size = size_text(len(TEXT))
    assert f"wiki.train.tokens.gz ({size}, gzip-compressed as written) from {mirror}/fake/" in out
    assert "2 files in" in out and "(2 downloaded)" in out

    download("fake", dest, mirror=closed_port(), corpora=registry())  # no server: kept
    assert written_right(dest)
    assert capsys.readouterr().out.count("kept ") == 2


def test_file_urls_and_a_changed_file_is_fetched_again(tmp_path, capsys):
    up = upstream(tmp_path / "mirror")
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "train.de.gz").write_bytes(b"edited")
    download("fake", dest, mirror=up.as_uri(), corpora=registry())
    assert written_right(dest)
    assert "differs from the recorded sha256" in capsys.readouterr().out


def test_a_wrong_checksum_names_the_file_and_keeps_nothing(tmp_path, mirror):
    dest = tmp_path / "out"
    wrong = "0" * 64
    with pytest.raises(DataError) as err:
        download("fake", dest, mirror=mirror, corpora=registry(sha_of_text=wrong))
    message = str(err.value)
    assert "wiki.train.tokens.gz: checksum mismatch" in message
    assert f"{mirror}/fake/train.txt" in message
    assert f"expected sha256 {wrong}, got {hashlib.sha256(TEXT).hexdigest()}" in message
    assert sorted(p.name for p in dest.iterdir()) == ["train.de.gz"]  # the good one, no .part


def test_a_dropped_connection_keeps_nothing_and_a_rerun_succeeds(tmp_path, mirror):
    dest = tmp_path / "out"
    server, half = serve(upstream(tmp_path / "half"), HalfBody)
    try:
        with pytest.raises(DataError, match=r"closed after \d+ of \d+ bytes") as err:
            download("fake", dest, mirror=half, corpora=registry())
    finally:
        server.shutdown()
        server.server_close()
    assert f"{half}/fake/train.de.gz" in str(err.value) and "Nothing was kept" in str(err.value)
    assert list(dest.iterdir()) == []
    download("fake", dest, mirror=mirror, corpora=registry())
    assert written_right(dest)


def test_an_unreachable_host_or_a_missing_file_names_the_url_and_how_to_copy_it(tmp_path, mirror):
    base = closed_port()
    with pytest.raises(DataError) as err:
        download("fake", tmp_path / "out", mirror=base, corpora=registry())
    message = str(err.value)
    assert f"could not download {base}/fake/train.de.gz" in message
    assert f"save it as {tmp_path / 'out' / 'train.de.gz'}" in message
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(DataError, match=r"fake/train.de.gz: HTTP Error 404: File not found"):
        download("fake", tmp_path / "out", mirror=f"{mirror}/elsewhere", corpora=registry())


def test_the_cli_lists_the_corpora_and_names_an_unknown_one(capsys):
    assert main(["data", "download", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}: " in out for name in ("multi30k", "tinyshakespeare", "wikitext-2"))
    assert main(["data", "download", "wmt14"]) == 2
    assert "no corpus named 'wmt14'" in capsys.readouterr().err


def test_every_url_is_pinned_to_a_commit():
    for corpus in CORPORA.values():
        for f in corpus.files:
            parts = f.url.split("/")
            assert f.url.startswith("https://raw.githubusercontent.com/"), f.url
            assert len(parts[5]) == 40 and int(parts[5], 16) >= 0, f.url


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"no shared corpora at {SHARED}")
@pytest.mark.parametrize("name", sorted(CORPORA))
def test_the_recorded_checksums_are_those_of_the_shared_copies(name):
    for f in CORPORA[name].files:
        path = SHARED / name / f.name
        if not path.is_file():
            pytest.skip(f"{path} is absent")
        assert stored_sha256(path, f.gzip) == f.sha256, path
        size = len(gzip.open(path).read()) if f.gzip else path.stat().st_size
        assert size == f.size, path


def test_a_recipe_reads_the_shared_copy_where_it_is_complete_and_else_the_download(
    tmp_path, monkeypatch
):
    root = tmp_path / "project"
    root.mkdir()
    shared = tmp_path / "shared" / "data" / "multi30k"
    shared.mkdir(parents=True)
    for f in CORPORA["multi30k"].files[:-1]:
        (shared / f.name).write_bytes(b"")
    assert corpus_dir("multi30k", root) == root / "data" / "corpora" / "multi30k"  # one missing
    (shared / CORPORA["multi30k"].files[-1].name).write_bytes(b"")
    assert corpus_dir("multi30k", root) == root / ".." / "shared" / "data" / "multi30k"

    # The recipe scripts' stage: the shared copy as the config names it, else downloaded and
    # the splits under ../shared/data/multi30k moved there; a split elsewhere is kept.
    ran = []
    monkeypatch.setattr(stages, "ROOT", root)
    monkeypatch.setattr(stages, "run", lambda args, capture=False: ran.append(args))
    data = dict(train="../shared/data/multi30k/train", valid="mine/val", test=None)
    cfg = SimpleNamespace(data=SimpleNamespace(**data))
    assert stages.corpus_overrides("multi30k", cfg) == [] and ran == []
    (shared / "val.en.gz").unlink()
    assert stages.corpus_overrides("multi30k", cfg) == ["data.train=data/corpora/multi30k/train"]
    assert ran == [["data", "download", "multi30k"]]
    demo = SimpleNamespace(data=SimpleNamespace(train="data/demo/train", valid=None, test=None))
    assert stages.corpus_overrides("multi30k", demo) == [] and len(ran) == 1  # nothing to fetch


def test_a_missing_recipe_corpus_says_how_to_download_it(tmp_path):
    with pytest.raises(DataError, match=r"`aiayn data download wikitext-2` writes it to data/corp"):
        expand_files(str(tmp_path / "shared" / "data" / "wikitext-2" / "wiki.train.tokens.gz"))
    assert "replace ../shared/data/multi30k with data/corpora/multi30k" in missing_corpus_hint(
        "../shared/data/multi30k/val"
    )
    assert missing_corpus_hint("data/tinyshakespeare/train.txt") == ""  # the recipe's split
    assert missing_corpus_hint("corpora/news/train") == ""
