"""The Hub dataset revision a run reads, fixed for its whole life.

A Hub dataset can change under a running job: a new commit re-orders or fixes records, and a
restart that streamed the new ones would resume a position counted in the old. With
data.hub_revision unset, the first start asks the Hub for the commit it serves now, records it
in `run_dir/data/hub_revision.json`, and every later start reads that commit, without asking
the Hub again. A set data.hub_revision is used as given, and recorded the same way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

from aiayn.config import Config
from aiayn.errors import DataError
from aiayn.runtime.durable import write_atomic

log = logging.getLogger(__name__)

RECORD = Path("data") / "hub_revision.json"  # under run_dir


def pin_hub_revision(cfg: Config, decide: Callable = lambda choose: choose()) -> Config:
    """`cfg` with data.hub_revision fixed for the run (see the module's docstring). Rank 0
    reads, resolves and records it; every rank gets the same answer (DistEnv.decide)."""
    data = cfg.data
    if data.format != "hub" or Path(str(data.hub_name)).is_dir():  # a local folder has none
        return cfg
    revision = decide(lambda: _recorded_or_resolved(cfg))
    return dataclasses.replace(cfg, data=dataclasses.replace(data, hub_revision=revision))


def _recorded_or_resolved(cfg: Config) -> str | None:
    try:
        return _decide(cfg, Path(cfg.run_dir) / RECORD)
    except OSError as exc:
        raise DataError(f"could not record the Hub revision in {cfg.run_dir}: {exc}") from None


def _decide(cfg: Config, path: Path) -> str | None:
    data = cfg.data
    recorded = json.loads(path.read_text()) if path.is_file() else None
    if recorded and recorded["name"] == data.hub_name:
        if data.hub_revision and data.hub_revision != recorded["revision"]:
            log.warning(
                "data.hub_revision=%s, the run recorded %s at its first start: reading %s",
                data.hub_revision,
                recorded["revision"],
                data.hub_revision,
            )
            return data.hub_revision
        return recorded["revision"]
    revision = data.hub_revision or _served_commit(data.hub_name)
    if revision is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"name": data.hub_name, "revision": revision}).encode())
    log.info("Hub dataset %s pinned at revision %s (%s)", data.hub_name, revision, path)
    return revision


def _served_commit(name: str) -> str | None:
    """The commit the Hub serves for dataset `name` now; None, with a warning, when it cannot
    be asked (offline): the run then reads what the local Hub cache holds, unpinned."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(name).sha
    except Exception as exc:  # offline, unreachable, or not found: loading will say which
        log.warning(
            "could not ask the Hub which commit of %s it serves (%s: %s); the run is not pinned "
            "to one: set data.hub_revision to pin it",
            name,
            type(exc).__name__,
            str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
        )
        return None
