"""What the recipes (multi30k.py, wmt14.py, lm_recipe.py) share: each stage is the `aiayn`
command a user would type, printed before it runs in the project root, and timed."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

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


def main_guard(name: str, main: Callable[[], int]) -> None:
    """Run `main` as a script: a user's error or a failed stage ends it with one line."""
    try:
        sys.exit(main())
    except AiaynError as e:  # a bad config or override: named before any stage runs
        sys.exit(f"{name}: {e}")
    except subprocess.CalledProcessError as e:  # the stage printed its own error above
        sub = e.cmd[e.cmd.index("aiayn") + 1]  # `-m aiayn SUB`, under a launcher too
        sys.exit(f"{name}: stopped, `aiayn {sub}` exited with {e.returncode}")
