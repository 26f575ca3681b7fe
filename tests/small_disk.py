"""A real filesystem that fills up: a size-limited tmpfs, for tests of what a full disk does.
Mounting needs root; where it is refused the test is skipped, saying why."""

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@contextmanager
def small_disk(where: Path, kib: int) -> Iterator[Path]:
    """A tmpfs of `kib` KiB mounted at `where` (made if missing), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"cannot mount a tmpfs at {where}: {detail}")
    try:
        yield where
    finally:
        # A file a failed write left open (torch.save's, until it is collected) keeps the
        # filesystem busy: detach it now, the kernel frees it when the last file closes.
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def resize(where: Path, kib: int) -> None:
    """Give the tmpfs at `where` `kib` KiB (at least what its files use)."""
    _mount("-o", f"remount,size={kib}k", str(where))


def used_kib(where: Path) -> int:
    usage = shutil.disk_usage(where)
    return (usage.total - usage.free) // 1024


def reported_sizes(message: str) -> tuple[float, float]:
    """(needed, free) in bytes, as a failed save's message states them."""
    units = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    found = re.search(
        r"It needs about ([\d.]+) (bytes|KiB|MiB|GiB); ([\d.]+) (bytes|KiB|MiB|GiB) are free",
        message,
    )
    assert found, f"no sizes in: {message}"
    need, need_unit, free, free_unit = found.groups()
    return float(need) * units[need_unit], float(free) * units[free_unit]
