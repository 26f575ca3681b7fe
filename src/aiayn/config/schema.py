"""The whole run configuration, Config: the top-level keys, the sections in the order a file
and docs/configuration.md list them, and the checks that involve several sections. Each section
is declared in its own module (model.py, data.py, training.py, run.py, decode.py); reading files
and overrides into a Config is loading.py's."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from aiayn import metric_names
from aiayn.config.checks import range_errors
from aiayn.config.data import DataConfig
from aiayn.config.decode import DecodeConfig
from aiayn.config.model import ModelConfig, TokenizerConfig
from aiayn.config.run import CheckpointConfig, DistributedConfig, InitConfig, LoggingConfig
from aiayn.config.training import OptimConfig, ScheduleConfig, TrainConfig


@dataclass
class Config:
    run_dir: str = "runs/default"
    """Everything a run writes: resolved config, checkpoints, logs, TensorBoard events."""
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    init: InitConfig = field(default_factory=InitConfig)

    def validate(self) -> list[str]:
        errs: list[str] = []
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                errs += range_errors(section, f.name) + section.validate()
        if self.model.kind != "seq2seq" and self.data.format == "parallel":
            errs.append(
                f"data.format parallel is for model.kind seq2seq; a {self.model.kind} model "
                "reads text, tsv, jsonl, parquet or hub data"
            )
        errs += self._validate_ranking()
        errs += self._validate_finish()
        scale = self.train.loss_scale_init
        if scale >= 1 and not math.log2(scale).is_integer():
            errs.append(
                f"train.loss_scale_init must be a power of two, got {scale:g} "
                f"(e.g. {2 ** round(math.log2(scale)):g})"
            )
        if self.train.deterministic and self.train.attention_kernel == "cudnn":
            errs.append(
                "train.attention_kernel=cudnn with train.deterministic=true: cuDNN's attention "
                "has no deterministic backward; set train.attention_kernel=auto (the "
                "memory-efficient kernel, deterministic under train.deterministic) or "
                "train.deterministic=false"
            )
        if (self.schedule.cooldown or 0) > self.train.max_steps:
            errs.append(
                f"schedule.cooldown ({self.schedule.cooldown}) must be at most train.max_steps "
                f"({self.train.max_steps}): the rate falls over the run's last steps (a cooldown "
                "that scales with max_steps: schedule.cooldown_fraction)"
            )
        stride = self.train.eval_stride
        if stride is not None and stride > self.data.max_len:
            errs.append(
                f"train.eval_stride ({stride}) must be at most the window, data.max_len "
                f"({self.data.max_len})"
            )
        if self.data.sources and self.model.kind == "lm":
            errs.append(
                "data.sources mixes translation or classification corpora; a language model "
                "(model.kind lm) trains on data.train"
            )
        if self.data.max_len + 2 > self.model.max_len:
            errs.append(
                f"data.max_len ({self.data.max_len}) + 2 special tokens exceeds model.max_len "
                f"({self.model.max_len}); lower data.max_len or raise model.max_len"
            )
        return errs

    def _validate_finish(self) -> list[str]:
        train, ckpt = self.train, self.checkpoint
        if not train.finish:
            return []
        kept, setting = (
            (ckpt.keep_last, "checkpoint.keep_last")
            if train.finish_select == "last"
            else (ckpt.keep_best, "checkpoint.keep_best")
        )
        if train.finish > kept:
            return [
                f"train.finish averages {train.finish} checkpoints ({train.finish_select}) but "
                f"{setting} keeps {kept}: raise {setting} to {train.finish} or lower train.finish"
            ]
        return []

    def _validate_ranking(self) -> list[str]:
        ckpt, train = self.checkpoint, self.train
        if not (ckpt.keep_best or train.patience):
            return []
        errs = []
        # Who ranks by validation: the messages name the setting that asks for it.
        who = "checkpoint.keep_best" if ckpt.keep_best else "train.patience"
        if not self.data.valid:
            errs.append(f"{who} ranks by validation: set data.valid")
        if ckpt.keep_best and (not train.eval_every or train.eval_every % max(ckpt.every_steps, 1)):
            errs.append(
                f"checkpoint.keep_best ranks checkpoints by the validation at their step: "
                f"train.eval_every ({train.eval_every}) must be a multiple of "
                f"checkpoint.every_steps ({ckpt.every_steps})"
            )
        if train.patience and not train.eval_every:
            errs.append(
                "train.patience counts validations without improvement: set train.eval_every "
                "(validations happen every train.eval_every steps)"
            )
        units = {metric_names.tag(name): unit for name, unit in metric_names.UNIT.items()}
        unit = units.get(ckpt.best_metric)
        if unit and (self.model.kind != "lm" or self.data.unit != unit):
            errs.append(
                f"checkpoint.best_metric {ckpt.best_metric} needs model.kind lm and "
                f"data.unit {unit}"
            )
        translated = ckpt.best_metric in map(metric_names.tag, metric_names.TRANSLATION)
        if translated and (self.model.kind != "seq2seq" or train.eval_bleu == 0):
            errs.append(
                f"checkpoint.best_metric {ckpt.best_metric} needs model.kind seq2seq and "
                "train.eval_bleu not 0 (the dev set translated at each validation)"
            )
        return errs

    @property
    def tokenizer_path(self) -> Path:
        if self.tokenizer.path:
            return Path(self.tokenizer.path)
        return Path(self.run_dir) / "tokenizer" / "spm.model"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            yaml.safe_dump(self.to_dict(), fh, sort_keys=False)
