"""A rank of benchmarks/validation_ranks.py: one validation of a trained checkpoint on its dev
set, as the training loop runs it (evaluate.Validation, each rank translating its share), timed;
rank 0 writes OUT/result.json.

    torchrun ... benchmarks/_validate_rank.py CHECKPOINT OUT [KEY=VALUE ...]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from aiayn.checkpoint.inference import load_for_inference  # noqa: E402
from aiayn.data.split_copies import copied_split  # noqa: E402
from aiayn.distributed.env import setup, teardown  # noqa: E402
from aiayn.engine.ddp_engine import LocalEngine  # noqa: E402
from aiayn.engine.recipe import recipe  # noqa: E402
from aiayn.eval.validation import Validation
from aiayn.train.monitor import Metrics  # noqa: E402


def main(checkpoint: str, out: str, *overrides: str) -> None:
    env = setup("cpu")
    cfg, model, tok, ckpt = load_for_inference(checkpoint, list(overrides), "cpu")
    cfg = copied_split(cfg, "valid", Path(checkpoint)) or cfg
    cfg = dataclasses.replace(cfg, run_dir=out)  # the hypotheses file goes there
    validation = Validation(cfg, tok, env)
    engine = LocalEngine(model, recipe(cfg, env.device), env.device)
    started = time.perf_counter()
    result = validation.run(engine, Metrics(out, env.is_main, tensorboard=False), 1, env)
    if env.is_main:
        result["wall_s"] = time.perf_counter() - started
        result["sentences"] = len(validation.sources)
        result["checkpoint"] = str(ckpt)
        Path(out, "result.json").write_text(json.dumps(result))
    teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])
