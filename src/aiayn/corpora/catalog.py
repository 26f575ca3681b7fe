"""The recipes' public corpora: what each holds, where it comes from, and where a recipe reads it.

Each file is pinned to one upstream commit and its sha256, so what a recipe trains on cannot
change under it; `aiayn data download NAME` (download.py) fetches and checks them. A recipe
reads `../shared/data/NAME` (beside the project root) where that folder holds every file of the
corpus, as on the test machines, and otherwise the downloaded copy in `data/corpora/NAME`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SHARED = Path("..") / "shared" / "data"  # beside the project root, where tests and CI keep them
DOWNLOADED = Path("data") / "corpora"  # under the project root (git-ignored)


@dataclass(frozen=True)
class RemoteFile:
    name: str
    """The file as a recipe reads it, in the corpus's folder."""
    url: str
    """The upstream file, pinned to a commit."""
    sha256: str
    """Of the upstream bytes (for `gzip`, of the text inside the stored file)."""
    size: int
    """Upstream bytes."""
    gzip: bool = False
    """Upstream is plain text, stored gzip-compressed under `name` (as the recipes read it)."""


@dataclass(frozen=True)
class Corpus:
    name: str
    about: str
    licence: str
    files: tuple[RemoteFile, ...]


def _multi30k() -> Corpus:
    # The commit that added data/task1/raw; no later commit changed these files.
    base = (
        "https://raw.githubusercontent.com/multi30k/dataset/"
        "c9be912dc05a3ebf9ae5bb5f7f58c1791cda43ab/data/task1/raw/"
    )
    files = [
        ("train.de.gz", "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6", 637044),
        ("train.en.gz", "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f", 568929),
        ("val.de.gz", "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a", 24681),
        ("val.en.gz", "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28", 21650),
        (
            "test_2016_flickr.de.gz",
            "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
            22890,
        ),
        (
            "test_2016_flickr.en.gz",
            "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
            21077,
        ),
    ]
    return Corpus(
        "multi30k",
        "Multi30k task 1, German-English, raw text (multi30k/dataset, data/task1/raw)",
        "no licence file; the repository's README: derived from Flickr30K, for non-commercial "
        "research and educational use",
        tuple(RemoteFile(name, base + name, digest, size) for name, digest, size in files),
    )


def _tinyshakespeare() -> Corpus:
    # The commit that added the file (char-rnn's first); no later commit changed it.
    url = (
        "https://raw.githubusercontent.com/karpathy/char-rnn/"
        "370cbcd448eb7daf32f21a6be560b70e0b33c4e3/data/tinyshakespeare/input.txt"
    )
    digest = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    return Corpus(
        "tinyshakespeare",
        "Tiny Shakespeare, 1,115,394 characters (karpathy/char-rnn, data/tinyshakespeare)",
        "Shakespeare's text (public domain); char-rnn is MIT",
        (RemoteFile("input.txt.gz", url, digest, 1115394, gzip=True),),
    )


def _wikitext2() -> Corpus:
    # pytorch/examples "Replace WikiText-2 files with correct dataset" (#264), the last commit
    # that changed them: WikiText-2 v1's wiki.*.tokens, byte for byte, under other names.
    base = (
        "https://raw.githubusercontent.com/pytorch/examples/"
        "d5678bc8ac0cdd79dbd5e44d4130271018bcec4e/word_language_model/data/wikitext-2/"
    )
    files = [
        ("train", "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f", 10797148),
        ("valid", "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8", 1121681),
        ("test", "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0", 1256449),
    ]
    return Corpus(
        "wikitext-2",
        "WikiText-2 v1, word-tokenised (pytorch/examples, word_language_model/data/wikitext-2)",
        "Creative Commons Attribution-ShareAlike (Wikipedia text, as Salesforce released it)",
        tuple(
            RemoteFile(f"wiki.{split}.tokens.gz", f"{base}{split}.txt", digest, size, gzip=True)
            for split, digest, size in files
        ),
    )


CORPORA: dict[str, Corpus] = {c.name: c for c in (_multi30k(), _tinyshakespeare(), _wikitext2())}


def corpus_dir(name: str, root: Path, corpora: dict[str, Corpus] = CORPORA) -> Path:
    """Where a recipe run in `root` reads corpus NAME: ../shared/data/NAME where it holds every
    file of the corpus, else data/corpora/NAME (which `aiayn data download NAME` fills)."""
    shared = root / SHARED / name
    if all((shared / f.name).is_file() for f in corpora[name].files):
        return shared
    return root / DOWNLOADED / name


def missing_corpus_hint(path: str, corpora: dict[str, Corpus] = CORPORA) -> str:
    """For a corpus path that was not found: how to get it, when it names a file (or a file
    prefix) of a recipe's corpus in a folder of the corpus's name; "" otherwise."""
    p = Path(path)
    corpus = corpora.get(p.parent.name)
    if corpus is None or not any(f.name.startswith(p.name) for f in corpus.files):
        return ""
    name, here = corpus.name, DOWNLOADED / corpus.name
    get = f". It is a file of the {name} corpus: `aiayn data download {name}` writes it to {here}"
    if p.parent.parts[-len(here.parts) :] == here.parts:
        return get
    return (
        f"{get}; then replace {p.parent} with {here} in data.train/valid/test (in the YAML, or "
        "as key=value overrides); or run the recipe's script, which does both (docs/recipes.md)"
    )
