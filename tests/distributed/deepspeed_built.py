"""What deepspeed.initialize builds from the config aiayn generates for CUDA, ZeRO-2 and bf16
(in a process group of one, gloo): the optimizer, and the dtype of each gradient reduction.
Prints it as JSON. Usage: python deepspeed_built.py"""

import json
import logging
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from aiayn.config import load_config
from aiayn.distributed.env import DistEnv, join_single_process_group
from aiayn.engine import deepspeed_config, op_builds
from aiayn.model import build_model

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers.py, for batches.py
sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from batches import TINY  # noqa: E402  (tests/unit/batches.py)

OVERRIDES = [
    *TINY,
    "distributed.backend=deepspeed",
    "distributed.zero_stage=2",
    "train.precision=bf16",
    "optim.name=adamw",
    "optim.weight_decay=0.01",
]


def main() -> None:
    join_single_process_group(DistEnv(0, 1, torch.device("cpu")))  # as DeepSpeedEngine does,
    op_builds.skip_inference_all_reduce()  # and this
    deepspeed.utils.logger.setLevel(logging.WARNING)
    cfg = load_config(None, OVERRIDES)
    model = build_model(cfg.model, 50, 0)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=list(model.parameters()),
        config=deepspeed_config.generate(cfg, world_size=1, device_type="cuda"),
        dist_init_required=False,
    )
    adam = engine.basic_optimizer
    print(
        json.dumps(
            {
                "optimizer": f"{type(adam).__module__}.{type(adam).__name__}",
                "defaults": {
                    k: adam.defaults[k] for k in ("betas", "eps", "weight_decay", "fused")
                },
                "reduce_dtypes": sorted(
                    {str(optimizer.get_param_comm_dtype(p)) for p in model.parameters()}
                ),
                "grad_dtype": str(next(model.parameters()).dtype),
                "bucket_dtypes": sorted(str(d) for d in optimizer.ipg_buckets),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
