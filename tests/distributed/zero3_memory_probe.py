"""Run by test_zero3_memory.py under torchrun: `aiayn train ARGS...` in this process, its
checkpoint saves and validations wrapped to record how far this rank's allocated host memory
rose during each (aiayn.runtime.malloc.AllocatedPeak: malloc's bytes in use, sampled every
millisecond), and after the first validation, as the control, how far it rises while the
engine builds a gathered whole-model copy (`engine.full_module()`, what a ZeRO-3 validation
used before): the instrument must see a whole model where there is one. Each rank writes
OUT/rank_<r>.json with the largest rise of each kind, in bytes.

usage: memory_probe.py OUT train --config ... [KEY=VALUE ...]
"""

import json
import os
import runpy
import sys
from pathlib import Path

from aiayn.checkpoint import manager
from aiayn.eval import validation
from aiayn.runtime.malloc import AllocatedPeak

rises = {"save": 0, "validation": 0, "whole_model_copy": 0, "ema_held": 0}


def measured(name: str, method):
    def wrapped(self, *args, **kwargs):
        with AllocatedPeak() as peak:
            result = method(self, *args, **kwargs)
        rises[name] = max(rises[name], peak.rise)
        return result

    return wrapped


def with_control(method):
    def wrapped(self, engine, *args, **kwargs):
        result = method(self, engine, *args, **kwargs)
        if not rises["whole_model_copy"]:  # a collective: every rank validates, so every rank
            with AllocatedPeak() as peak, engine.full_module():  # comes here
                pass
            rises["whole_model_copy"] = peak.rise
        if engine.ema is not None and engine.ema.shadow is not None:
            rises["ema_held"] = sum(t.numel() * t.element_size() for t in engine.ema.shadow)
        return result

    return wrapped


if __name__ == "__main__":
    out = Path(sys.argv[1])
    manager.CheckpointManager.save = measured("save", manager.CheckpointManager.save)
    validation.Validation.run = with_control(measured("validation", validation.Validation.run))
    sys.argv = ["aiayn", *sys.argv[2:]]
    try:
        runpy.run_module("aiayn", run_name="__main__")
    except SystemExit as done:
        if done.code:
            raise
    (out / f"rank_{os.environ['RANK']}.json").write_text(json.dumps(rises))
