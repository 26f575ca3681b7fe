"""What the recipes (multi30k.py, wmt14.py, lm_recipe.py, ...) share: each stage is the `aiayn`
command a user would type, printed before it runs in the project root, and timed; the corpus
each reads, from ../shared/data where it is there and downloaded otherwise."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aiayn.corpora.catalog import SHARED, corpus_dir
from aiayn.errors import AiaynError

ROOT = Path(__file__).resolve().parent.parent
AIAYN = [sys.executable, "-m", "aiayn"]


def run(args: list[str], capture: bool = False) -> str:
    """`aiayn ARGS` in ROOT; its stdout when `capture`. A failure raises CalledProcessError."""
    print("+ aiayn " + shlex.join(args), flush=True)
    done = subprocess.run(AIAYN + args, cwd=ROOT, check=True, text=True, capture_output=capture)
    return done.stdout if capture else ""


class Stages:
    """Wall time of each stage (`with stages("train"): ...`) and of the whole recipe."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        began = time.perf_counter()
        yield
        self.times[name] = time.perf_counter() - began

    def done(self) -> None:
        self.times["total"] = time.perf_counter() - self._start


def tokenizer_once(path: Path, common: list[str]) -> None:
    """Train the tokenizer unless it exists: a resumed or re-scored run keeps its vocabulary."""
    if path.exists():
        print(f"tokenizer {path} exists: kept")
    else:
        run(["tokenizer", "train", *common])


def corpus(name: str) -> Path:
    """A recipe's corpus NAME (aiayn/corpora/catalog.py), relative to ROOT: ../shared/data/NAME
    where it holds every file (tests, CI), else data/corpora/NAME, filled by `aiayn data download
    NAME` (which keeps the files already there and right, so a rerun reads no network)."""
    where = corpus_dir(name, ROOT)
    if where != ROOT / SHARED / name:
        run(["data", "download", name])
    else:
        print(f"{name}: {SHARED / name} (the shared copy beside the project)", flush=True)
    return Path(os.path.relpath(where, ROOT))


def corpus_overrides(name: str, cfg) -> list[str]:
    """The `corpus` stage: data.train/valid/test=... for each split the config reads from
    ../shared/data/NAME, moved to where corpus() finds (or downloads) it; none when that is
    ../shared/data/NAME itself. A config that reads nothing from there (another corpus, a demo)
    needs no lookup and gets none."""
    shared = os.path.normpath(ROOT / SHARED / name)
    splits = {}
    for split in ("train", "valid", "test"):
        path = getattr(cfg.data, split)
        if isinstance(path, str):  # not None
            full = os.path.normpath(ROOT / path)
            if full.startswith(shared + os.sep):
                splits[split] = (path, os.path.relpath(full, shared))
    if not splits:
        print(f"{name}: the config reads no split from {SHARED / name}: nothing to fetch")
        return []
    where = corpus(name)
    return [
        f"data.{split}={where / rest}"
        for split, (path, rest) in splits.items()
        if str(where / rest) != path
    ]


def main_guard(name: str, main: Callable[[], int]) -> None:
    """Run `main` as a script: a user's error or a failed stage ends it with one line."""
    try:
        sys.exit(main())
    except AiaynError as e:  # a bad config or override: named before any stage runs
        sys.exit(f"{name}: {e}")
    except subprocess.CalledProcessError as e:  # the stage printed its own error above
        sub = e.cmd[e.cmd.index("aiayn") + 1]  # `-m aiayn SUB`, under a launcher too
        sys.exit(f"{name}: stopped, `aiayn {sub}` exited with {e.returncode}")
