"""The dev sets a run validates on: data.valid (which early stopping and checkpoint ranking
read) and each data.sources entry's own (scored and shown as valid_<source>), each on the run's
copy of its split so that a restart reads no source; and a copy of data.test for `aiayn
evaluate`."""

from __future__ import annotations

import contextlib
import logging

from aiayn.config import Config
from aiayn.data.mixture import as_train
from aiayn.data.split_copies import with_run_copy
from aiayn.distributed.env import DistEnv
from aiayn.errors import DataError
from aiayn.eval.validation import Validation
from aiayn.metric_names import PREFIX
from aiayn.tokenizer import Tokenizer

log = logging.getLogger("aiayn")


class DevSets:
    def __init__(self, cfg: Config, tok: Tokenizer, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.valid = None
        if cfg.data.valid:  # on the run's copy of the split: a restart reads no source
            local = with_run_copy(cfg, "valid", env.decide)
            self.valid = Validation(local, tok, env)
        self.per_source = _source_validations(cfg, tok, env)
        if cfg.data.test:  # for `aiayn evaluate`; training does not need it, so it cannot stop it
            try:
                with_run_copy(cfg, "test", env.decide)
            except DataError as exc:
                log.warning("%s; `aiayn evaluate --split test` will read the source", exc)

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.train.eval_every
        return bool(every and step % every == 0) or last

    def validate(self, engine, metrics, step: int) -> dict[str, float] | None:
        """Every dev set validated (every rank calls it); data.valid's scores, or None. With
        train.ema_validate, of the EMA of the weights, swapped in for the while."""
        swapped = engine.ema_applied() if self.cfg.train.ema_validate else contextlib.nullcontext()
        with swapped:
            valid = self.valid.run(engine, metrics, step, self.env) if self.valid else None
            for each in self.per_source:  # scored and shown; data.valid ranks
                each.run(engine, metrics, step, self.env)
        return valid


def _source_validations(cfg: Config, tok: Tokenizer, env: DistEnv) -> list[Validation]:
    """A Validation of each data.sources entry's own dev set (on the run's copy of it), logged
    as valid_<name>/...: untagged, like data.valid and inference."""
    out = []
    for source in (s for s in cfg.data.sources if s.valid):
        name = f"{PREFIX}_{source.name}"
        local = with_run_copy(as_train(cfg, source), "valid", env.decide, name=name)
        out.append(Validation(local, tok, env, prefix=name))
    return out
