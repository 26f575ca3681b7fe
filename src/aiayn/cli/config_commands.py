"""`aiayn config show` and `aiayn config check`: a run config read as a start would read it,
without starting."""

from __future__ import annotations

import json
import os

from aiayn.cli.common import add_config, add_json, command, group

CONFIG_OVERRIDES = "train.max_steps=200 model.dropout=0"


def add_parsers(sub) -> None:
    config_sub = group(sub, "config", "show or check a run config", "config_command")
    p = command(
        config_sub,
        "show",
        "the effective config, and where each value came from",
        "Print every key of the config a start would use, with where its value came from:\n"
        "default, preset (model.preset), file (--config) or override (the command line).",
        [
            "aiayn config show --config configs/demo.yaml",
            "aiayn config show --config configs/demo.yaml --json train.max_steps=200",
        ],
    )
    add_config(p, CONFIG_OVERRIDES)
    add_json(p)
    p = command(
        config_sub,
        "check",
        "check a config as a start would, without training",
        "Check what a start of `aiayn train` would refuse, without training: the keys and\n"
        "values, the corpus files and init.source exist, the tokenizer matches the contract\n"
        "the run's checkpoints recorded, and --world-size ranks can share\n"
        "train.tokens_per_step. Every problem is reported; exit 2 if there is one.",
        [
            "aiayn config check --config configs/demo.yaml",
            "aiayn config check --config configs/wmt14_en_de_base.yaml --world-size 8",
        ],
    )
    add_config(p, CONFIG_OVERRIDES)
    p.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="the ranks the run will have ($WORLD_SIZE where set)",
    )
    add_json(p)


def cmd_config(args) -> int:
    if args.config_command == "show":
        return _show(args)
    return _check(args)


def _show(args) -> int:
    from aiayn.config.provenance import effective

    values = effective(args.config, args.overrides)
    if args.json:
        print(json.dumps(values, indent=1))
        return 0
    width = max(map(len, values))
    for key, entry in values.items():
        print(f"{key:<{width}}  {json.dumps(entry['value'])}  ({entry['source']})")
    return 0


def _check(args) -> int:
    from aiayn.config import load_config
    from aiayn.errors import ConfigError
    from aiayn.train.preflight import preflight

    cfg = load_config(args.config, args.overrides)  # keys, types, ranges: all at once
    ok, problems = preflight(cfg, args.world_size)
    if args.json:
        print(json.dumps({"ok": ok, "problems": problems}, indent=1))
    else:
        for line in ok:
            print(f"ok  {line}")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{len(problems)} problem(s) a start would stop on:\n{lines}")
    if not args.json:
        print(f"{args.config}: a start would accept it")
    return 0


COMMANDS = {"config": cmd_config}
