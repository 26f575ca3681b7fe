"""What a launcher asked for, as config overrides: `accelerate launch`'s choices take effect.

accelerate starts the processes with torchrun's environment (RANK, WORLD_SIZE, ...), which
`env.setup` reads, and passes its own options as ACCELERATE_* variables. We use accelerate as
a launcher only (its Accelerator misdetects the world size on CPU and its DeepSpeed path
imports transformers), so those options are mapped onto our config here, with the same
standing as command-line overrides given before the user's own:

| accelerate launch option            | variable                                      | override                                 |
| ----------------------------------- | --------------------------------------------- | ---------------------------------------- |
| --use_deepspeed                     | ACCELERATE_USE_DEEPSPEED=true                 | distributed.backend=deepspeed            |
| --zero_stage K                      | ACCELERATE_DEEPSPEED_ZERO_STAGE=K             | distributed.zero_stage=K                 |
| --offload_optimizer_device cpu      | ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE | distributed.offload_optimizer=true       |
| --offload_param_device cpu          | ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE     | distributed.offload_params=true          |
| --deepspeed_config_file F           | ACCELERATE_DEEPSPEED_CONFIG_FILE              | distributed.deepspeed_config=F           |
| --gradient_accumulation_steps N     | ACCELERATE_GRADIENT_ACCUMULATION_STEPS        | train.grad_accum=N                       |
| --gradient_clipping X               | ACCELERATE_GRADIENT_CLIPPING                  | train.clip_norm=X                        |
| --mixed_precision bf16 / fp16       | ACCELERATE_MIXED_PRECISION                    | train.precision=bf16 / fp16              |

`--mixed_precision no` (accelerate's default, set on every launch) leaves train.precision as
the config has it, and `--gradient_accumulation_steps 1` (`accelerate config`'s default) leaves
the accumulation to the config, where train.tokens_per_step may derive it. The user's own `key=value` arguments come after these and win.
"""  # noqa: E501 (the table reads best on one line per option)

from __future__ import annotations

from collections.abc import Mapping

from aiayn.errors import ConfigError

PREFIX = "ACCELERATE_"


def accelerate_overrides(environ: Mapping[str, str]) -> list[str]:
    """Dotted overrides for the ACCELERATE_* variables in `environ` (none outside accelerate)."""
    out = []
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        out.append("distributed.backend=deepspeed")
        if "ACCELERATE_DEEPSPEED_ZERO_STAGE" in environ:
            out.append(f"distributed.zero_stage={environ['ACCELERATE_DEEPSPEED_ZERO_STAGE']}")
        for var, key in (
            ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer"),
            ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "offload_params"),
        ):
            device = environ.get(var, "none").lower()
            if device not in ("none", "cpu"):
                raise ConfigError(f"{var}={device}: only cpu offload is supported (or none)")
            if device == "cpu":
                out.append(f"distributed.{key}=true")
        config_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if config_file.lower() != "none":
            out.append(f"distributed.deepspeed_config={config_file}")
    accumulation = environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    if accumulation != "1":  # `accelerate config`'s default: it would contradict tokens_per_step
        out.append(f"train.grad_accum={accumulation}")
    if "ACCELERATE_GRADIENT_CLIPPING" in environ:
        out.append(f"train.clip_norm={environ['ACCELERATE_GRADIENT_CLIPPING']}")
    precision = environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision in ("bf16", "fp16"):
        out.append(f"train.precision={precision}")
    elif precision not in ("no", ""):
        raise ConfigError(f"ACCELERATE_MIXED_PRECISION={precision}: use no, bf16 or fp16")
    return out
