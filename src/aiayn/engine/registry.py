"""The engines, by the name distributed.backend gives them: a new engine is one module with its
`KIND` (engine/kind.py) and one line here. The rest of the code asks this module, never an
engine's name: which engine a config builds and whether it fits the config (`check`, at start
and in `aiayn config check`), the topology a checkpoint was written on, and which rank wrote
which of its files.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from torch import nn

from aiayn.config import Config
from aiayn.config.checks import suggest
from aiayn.config.run import DistributedConfig
from aiayn.distributed.env import DistEnv
from aiayn.engine import ddp_engine, deepspeed_config, fsdp_engine, parallelize
from aiayn.engine.kind import Kind, Topology
from aiayn.engine.recipe import recipe
from aiayn.errors import ConfigError

ENGINES: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        ddp_engine.KIND,
        deepspeed_config.KIND,
        fsdp_engine.KIND,
    )
}


def problems(cfg: Config) -> list[str]:
    """What in the config the chosen engine refuses: an unknown engine, another engine's
    options set, and the engine's own checks."""
    name, defaults = cfg.distributed.backend, DistributedConfig()
    if name not in ENGINES:
        return [
            f"distributed.backend {name!r} is no engine; choose from {', '.join(ENGINES)}"
            + suggest(name, ENGINES)
        ]
    errs = []
    for kind in ENGINES.values():
        used = [
            f"distributed.{option}"
            for option in kind.options
            if kind.name != name and getattr(cfg.distributed, option) != getattr(defaults, option)
        ]
        if used:
            errs.append(f"{', '.join(used)} need distributed.backend={kind.name}")
    return errs + ENGINES[name].check(cfg)


def check(cfg: Config) -> None:
    """Raise a ConfigError listing `problems`, if any: at a start, before any work."""
    errs = problems(cfg)
    if errs:
        lines = "\n".join(f"  - {e}" for e in errs)
        raise ConfigError(f"invalid configuration for its engine:\n{lines}")


def topology(cfg: Config, world_size: int) -> Topology:
    """The topology a run of `cfg` on `world_size` ranks saves."""
    return saved_topology({"distributed": dataclasses.asdict(cfg.distributed)}, world_size)


def saved_topology(config: dict[str, Any], world_size: int) -> Topology:
    """The topology of a checkpoint, from the config it recorded (a dict)."""
    distributed = config.get("distributed", {})
    name = distributed.get("backend", DistributedConfig().backend)
    if name not in ENGINES:
        raise ConfigError(
            f"the checkpoint was written by engine {name!r}, which this aiayn does not have "
            f"({', '.join(ENGINES)}): resume it with the aiayn that wrote it"
        )
    kind = ENGINES[name]
    return Topology(kind, kind.layout(distributed), world_size)


def shard_rank(name: str) -> int | None:
    """The rank that wrote a file of a checkpoint in an engine's own format (and verifies it
    at a resume); None for the files every rank writes a range of."""
    for kind in ENGINES.values():
        rank = kind.shard_rank(name)
        if rank is not None:
            return rank
    return None


def build_engine(model: nn.Module, cfg: Config, env: DistEnv, rebuild=None) -> Any:
    """The engine distributed.backend names, around `model`, with activation checkpointing and
    compile applied to its layers and the one `Recipe` every engine trains with. `rebuild`
    makes a fresh model of the same architecture (a partitioned engine gathers weights into
    it). The engine's module is imported here: DeepSpeed's takes seconds to import, and it is
    optional."""
    check(cfg)
    parallelize.apply(model, cfg)  # before an engine wraps or shards the layers
    module, function = ENGINES[cfg.distributed.backend].build.split(":")
    engine = getattr(importlib.import_module(module), function)
    return engine(model, cfg, env, recipe(cfg, env.device), rebuild)
