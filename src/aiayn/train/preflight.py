"""`aiayn config check`: what a start of `aiayn train` would refuse, found without training,
without a process group and without the network, every problem reported together.

It checks the config itself (keys, types, ranges: load_config), that the corpus files and
init.source exist, the tokenizer against the contract the run's latest checkpoint recorded,
that the engine takes the distributed settings, and that `world_size` ranks can share
train.tokens_per_step's micro-batches. A Hub dataset is
named but not looked up (that needs the network; the start pins its revision)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from aiayn.checkpoint.format import checkpoints_in, read_manifest
from aiayn.checkpoint.locate import locate
from aiayn.config import Config
from aiayn.data.splits import source_files
from aiayn.engine import registry as engines
from aiayn.errors import AiaynError
from aiayn.tokenizer import Tokenizer, check_contract


def preflight(cfg: Config, world_size: int) -> tuple[list[str], list[str]]:
    """(what was checked and holds, the problems a start would stop on), one line each."""
    checks = [partial(_split, cfg, name, split) for name, split in _splits(cfg)]
    checks += [partial(_init_source, cfg), partial(_tokenizer, cfg)]
    checks += [partial(_engine, cfg, world_size), partial(_batch, cfg, world_size)]
    ok: list[str] = []
    problems: list[str] = []
    for check in checks:
        try:
            ok += check()
        except AiaynError as exc:
            problems.append(str(exc))
    return ok, problems


def _splits(cfg: Config) -> list[tuple[str, str]]:
    """(name, split) of every split of the corpus the run reads."""
    data = cfg.data
    splits = [("data.train", data.train), ("data.valid", data.valid), ("data.test", data.test)]
    splits += [(f"data.sources {s.name}", s.path) for s in data.sources]
    splits += [(f"data.sources {s.name} valid", s.valid) for s in data.sources]
    return [(name, split) for name, split in splits if split]


def _split(cfg: Config, name: str, split: str) -> list[str]:
    if cfg.data.format == "hub":
        return [f"{name}: {split} of {cfg.data.hub_name} (the Hub: not looked up offline)"]
    files = source_files(cfg.data, split)  # DataError naming what is missing
    return [f"{name}: {len(files)} file(s) found ({split})"]


def _init_source(cfg: Config) -> list[str]:
    if cfg.init.source is None:
        return []
    found = locate(cfg.init.source)  # CheckpointError naming what is missing
    return [f"init.source: {found.kind} {found.checkpoint}"]


def _tokenizer(cfg: Config) -> list[str]:
    path = cfg.tokenizer_path
    if not path.is_file():
        if cfg.init.source is not None:
            return [f"tokenizer: {path} missing; the start copies init.source's"]
        return [f"tokenizer: {path} missing; the start trains it (aiayn tokenizer train)"]
    tok = Tokenizer(path)
    ckpts = checkpoints_in(Path(cfg.run_dir) / "checkpoints")
    if not ckpts:
        return [f"tokenizer: {path}, vocabulary {tok.vocab_size} ({tok.type})"]
    recorded: dict[str, Any] = read_manifest(ckpts[-1], verify=False)["tokenizer"]
    check_contract(recorded, tok, where=str(ckpts[-1]))  # TokenizerError listing each field
    return [f"tokenizer: {path} is the one {ckpts[-1]} recorded (the run resumes from it)"]


def _engine(cfg: Config, world_size: int) -> list[str]:
    engines.check(cfg)  # ConfigError listing what the engine refuses
    return [f"engine: {engines.topology(cfg, world_size)}"]


def _batch(cfg: Config, world_size: int) -> list[str]:
    shares = cfg.train.batch(world_size)  # ConfigError when the ranks cannot share
    return [f"batch: {shares} = {cfg.train.step_tokens(world_size):,} tokens a step"]
