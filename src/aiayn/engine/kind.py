"""What an engine is, as the code outside the engine sees it (`Kind`), and the layout of the
state a checkpoint of it holds on disk (`Topology`).

Each engine module declares its `KIND`; engine/registry.py lists them by distributed.backend.
The checkpoint code asks the topology whether a checkpoint loads in an engine's own format, and
the kind how to read it otherwise, so it names no engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.engine.state import Portable

Reader = Callable[[Path, dict[str, Any], dict], contextlib.AbstractContextManager[Portable]]
"""(checkpoint, rank 0's trainer state, the trainable parameters' shapes) -> its Portable
state, open while the `with` lasts."""


def _no_problems(cfg: Any) -> list[str]:
    return []


def _no_layout(distributed: dict[str, Any]) -> str:
    return ""


def _no_shards(name: str) -> int | None:
    return None


@dataclass(frozen=True)
class Kind:
    """An engine as the rest of the code knows it."""

    name: str  # what distributed.backend names it
    title: str  # how logs and errors name it
    # "module:function" (model, cfg, env, recipe, rebuild) -> Engine, imported when used.
    build: str
    options: tuple[str, ...] = ()  # the distributed.* keys that only this engine reads
    check: Callable[[Any], list[str]] = _no_problems  # the run config's problems for it
    # What besides the world size decides its files' layout, from the distributed section as
    # a checkpoint saved it (a dict): "ZeRO-3".
    layout: Callable[[dict[str, Any]], str] = _no_layout
    any_world: bool = False  # its own files load on any number of ranks
    # The rank that wrote (and verifies) a file of a checkpoint; None: the range writer's.
    shard_rank: Callable[[str], int | None] = _no_shards
    # How another engine reads its files as a Portable state; None: the checkpoint's own
    # tensor files hold all of it (model.safetensors and the torch optimizer's state).
    portable: Reader | None = None


@dataclass(frozen=True)
class Topology:
    """What decides the layout of a checkpoint's weights and optimizer state on disk."""

    kind: Kind
    layout: str
    world_size: int

    def __str__(self) -> str:
        what = f"{self.kind.title} {self.layout}".strip()
        return f"{what} on {self.world_size} rank(s)"

    def same_layout(self, other: Topology) -> bool:
        """True if an engine of `other` loads this topology's files in its own format."""
        if (self.kind.name, self.layout) != (other.kind.name, other.layout):
            return False
        return self.kind.any_world or self.world_size == other.world_size
