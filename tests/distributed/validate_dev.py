"""Run by test_validation.py, alone or under torchrun: one validation, as the training loop
runs it, of a model initialised from seed 0 (the same untrained model on every rank) on the
distributed tests' dev set, with the engine the config names (DDP, DeepSpeed ZeRO-3). Each
rank writes OUT/rank_<r>.json: the dev sentences it translated, the metrics it got back,
whether its engine's model is partitioned, and (ZeRO-3) the largest share of the model it held
gathered at once. Several validations, each with its own run_dir, out and overrides, share one
launch and process group (start-up is most of a launch's cost).

usage: validate_dev.py CONFIG RUN_DIR OUT [KEY=VALUE ...] [-- RUN_DIR OUT [KEY=VALUE ...]] ...
"""

import json
import os
import sys
from pathlib import Path

import torch

from aiayn.config import load_config
from aiayn.distributed.env import setup, teardown
from aiayn.engine import build_engine
from aiayn.eval.validation import Validation
from aiayn.model import build_model
from aiayn.tokenizer import Tokenizer
from aiayn.train.monitor import Metrics

from train_runs import runs_of  # beside this file


def watch_gathered(module: torch.nn.Module) -> list[float]:
    """ZeRO-3: the share of the model's parameters gathered whole on this rank, sampled as each
    layer's forward begins (a list that grows while the forward hooks are there)."""
    params = list(module.parameters())
    total = sum(p.ds_numel for p in params)
    seen: list[float] = []

    def sample(*_):
        seen.append(sum(p.ds_numel for p in params if p.ds_status.name == "AVAILABLE") / total)

    for sub in module.modules():
        sub.register_forward_pre_hook(sample)
        sub.register_forward_hook(sample)
    return seen


def validate(env, config: str, run_dir: str, out: str, *overrides: str) -> None:
    cfg = load_config(config, [f"run_dir={run_dir}", "train.eval_bleu=null", *overrides])
    tok = Tokenizer(cfg.tokenizer_path)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok.vocab_size, tok.pad_id)
    engine = build_engine(model, cfg, env, lambda: build_model(cfg.model, tok.vocab_size, 0))
    validation = Validation(cfg, tok, env)
    whole = watch_gathered(engine.module) if engine.partitioned else [1.0]
    result = validation.run(engine, Metrics(run_dir, env.is_main, tensorboard=False), 1, env)
    translated = sorted(i for batch in validation.mine for i in batch)
    got = {"translated": translated, "result": result, "partitioned": engine.partitioned}
    got["most_gathered"] = max(whole, default=None)  # None: the partitioned layers never ran
    Path(out, f"rank_{env.rank}.json").write_text(json.dumps(got))


def main(config: str, *args: str) -> None:
    env = setup("cpu")
    for run in runs_of(args):
        validate(env, config, *run)
    teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # About one run in three (at 616b2e2 as now) aborted after its work was done and its file
    # written: "terminate called without an active exception" in the interpreter's finalisation,
    # on the main thread with no Python frame (C++ static destructors of a library the streamed
    # dev set loads: datasets, pyarrow). The test checks the work, not the process's exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
