"""Training: builds the pieces in order and runs the loop. Imports the others; imported by none
but the CLI.

text -> tokenizer -> BatchLoader -> model -> loss -> engine (backward, clip, optimizer, schedule)
-> checkpoint manager and metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aiayn import memory_probe
from aiayn.checkpoint import CheckpointManager, Progress, init_source, read_manifest
from aiayn.config import Config
from aiayn.data import (
    BatchLoader,
    CachedLoader,
    StepBatches,
    TokenCache,
    ensure_cache,
    make_loader,
    sample_sentences,
)
from aiayn.data.batch import resolve_pad_to_multiple
from aiayn.data.hub_revision import pin_hub_revision
from aiayn.data.mixed_loader import MixedLoader, tag_ids
from aiayn.data.mixed_stream import MixedStream
from aiayn.data.mixture import as_train, cache_folder, tokenizer_sample
from aiayn.data.run_splits import with_run_copy
from aiayn.distributed import faults
from aiayn.distributed.env import DistEnv, setup, teardown, use_timeout
from aiayn.engine.interface import Engine, build_engine
from aiayn.engine.precision import resolve_precision
from aiayn.errors import CheckpointError, DataError, PeerError, TrainingError
from aiayn.eval.finish import finish
from aiayn.eval.validation import Validation
from aiayn.files import bytes_hashed
from aiayn.flops import datasheet_peak, device_peak_flops, raise_kept_peak, training_flops
from aiayn.loss import batch_loss
from aiayn.malloc import keep_freed_memory
from aiayn.metric_names import PREFIX
from aiayn.metrics import Metrics, ProgressBar, cuda_memory, memory_bytes, setup_logging
from aiayn.model import build_model, count_parameters, selection
from aiayn.preemption import REQUEUE_EXIT_CODE, Preempted, StopFlag, StopVote
from aiayn.seeding import seed_everything
from aiayn.startup import StartupTimes
from aiayn.tokenizer import Tokenizer, train_tokenizer
from aiayn.torch_runtime import configure

log = logging.getLogger("aiayn")


def prepare_tokenizer(cfg: Config, retrain: bool = False) -> Tokenizer:
    """Load the run's tokenizer, training it first from the training stream if it is missing."""
    path = cfg.tokenizer_path
    if path.is_file() and not retrain:
        return Tokenizer(path)
    n = cfg.tokenizer.sample_sentences
    log.info(
        "training a %s tokenizer (vocab %d) on up to %d sentences of %s -> %s",
        cfg.tokenizer.type,
        cfg.tokenizer.vocab_size,
        n,
        cfg.data.train or ", ".join(s.name for s in cfg.data.sources),
        path,
    )
    if not cfg.data.sources:
        sentences = sample_sentences(cfg.data, cfg.model.kind, n, cfg.tokenizer.seed)
        return train_tokenizer(cfg.tokenizer, sentences, path)
    return train_tokenizer(*tokenizer_sample(cfg, n), path)


def prepare_data(
    cfg: Config, env: DistEnv, rebuild: bool = False
) -> tuple[Tokenizer, TokenCache | list[TokenCache] | None]:
    """The tokenizer (trained by rank 0 if missing) and, with data.cache, the training split's
    token cache (built by all ranks together if missing), or a list of each data.sources
    entry's cache. Every rank calls it."""
    if env.is_main:  # one writer: the others wait, then load what it trained
        tok = prepare_tokenizer(cfg)
    env.barrier()
    if not env.is_main:
        tok = Tokenizer(cfg.tokenizer_path)
    tag_ids(cfg.data, tok)  # a tag the tokenizer splits: refused before any cache is built
    if not cfg.data.cache:
        if env.distributed and env.is_main:
            log.warning(
                "data.cache=false on %d ranks: every rank reads and tokenises the whole training "
                "stream and keeps 1/%d of it, so each rank gets 1/%d of one process's input rate. "
                "Set data.cache=true to tokenise once, shared by the ranks",
                env.world_size,
                env.world_size,
                env.world_size,
            )
        return tok, None
    shared = cfg.data.cache_scope == "shared"
    # A node-local cache: each node's copy, built by its ranks together, verified by its first.
    rank, world, sync = (
        (env.rank, env.world_size, env.gather)
        if shared
        else (env.local_rank, env.local_world_size, env.node_gather)
    )
    if cfg.data.sources:  # a mixture: a cache per source, each keyed by its own corpus
        caches = [
            ensure_cache(
                as_train(cfg, source),
                "train",
                tok,
                rank=rank,
                world_size=world,
                sync=sync,
                rebuild=rebuild,
                folder=cache_folder(source),
            )
            for source in cfg.data.sources
        ]
    else:
        caches = [
            ensure_cache(cfg, "train", tok, rank=rank, world_size=world, sync=sync, rebuild=rebuild)
        ]
    if not shared:
        for cache in caches:
            _same_tokens_on_every_node(env, cache)
    return tok, caches if cfg.data.sources else caches[0]


def _same_tokens_on_every_node(env: DistEnv, cache: TokenCache) -> None:
    """Every node trains on what rank 0's copy holds: one broadcast, one sum."""
    ours = env.broadcast(cache.digest)
    differ = env.sum([float(cache.digest != ours)])[0]
    if differ:
        raise DataError(
            f"data.cache_scope=node: {int(differ)} rank(s) hold a token cache in {cache.root} "
            "with other tokens than rank 0's copy: the nodes built theirs from different "
            "corpus files or settings. Remove the copies (aiayn data prepare --force on each "
            "node rebuilds them) and give every node the same corpus"
        )


@dataclass
class Window:
    """Statistics between two log lines. Loss and accuracy stay on the device (no host sync
    per step); timings and FLOPs are host-side arithmetic."""

    loss: torch.Tensor | float = 0.0
    correct: torch.Tensor | float = 0.0
    tokens: int = 0
    steps: int = 0
    flops: int = 0
    data_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, tokens: int) -> None:
        self.loss = self.loss + loss.detach().float()
        self.correct = self.correct + correct
        self.tokens += tokens


@dataclass
class Run:
    """The assembled pieces of one training run."""

    cfg: Config
    env: DistEnv
    tok: Tokenizer
    engine: Engine
    loader: BatchLoader | CachedLoader
    ckpts: CheckpointManager
    metrics: Metrics
    progress: Progress
    peak_flops: float
    peak_measured: bool  # a matmul measured at the first start, not a data sheet's or configured
    stop: StopFlag
    startup: StartupTimes
    init: dict | None = None  # init.source's provenance (checkpoint/init_source.py)
    vote: StopVote = field(init=False)

    def __post_init__(self) -> None:
        self.vote = StopVote(self.env, self.stop)


def train(cfg: Config, explicit: frozenset[str] | None = None) -> dict[str, float]:
    """Train until train.max_steps (or train.max_epochs); return the last validation metrics.
    `explicit`: the keys the config file and overrides set (config.keys_set), which
    init.source's model does not override; None: the values other than the defaults."""
    startup = StartupTimes.of_this_process()
    try:
        with StopFlag() as stop:
            run = _assemble(cfg, stop, startup, explicit)
            try:
                return _loop(run)
            finally:
                run.metrics.close()
    finally:
        teardown()


def _resolved(cfg: Config, device: torch.device) -> Config:
    """`cfg` with what it leaves to the run decided, so that config.yaml and the checkpoints
    record what the run used: the precision (auto), pad_to_multiple (None) and the cooldown in
    steps (a fraction of train.max_steps)."""
    precision = resolve_precision(cfg.train.precision, device)
    multiple = resolve_pad_to_multiple(cfg.data.pad_to_multiple, device)
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, precision=precision),
        data=dataclasses.replace(cfg.data, pad_to_multiple=multiple),
        schedule=cfg.schedule.in_steps(cfg.train.max_steps),
    )


def _assemble(
    cfg: Config, stop: StopFlag, startup: StartupTimes, explicit: frozenset[str] | None = None
) -> Run:
    with startup.phase("process group"):
        env = setup(cfg.train.device, cfg.distributed.setup_timeout_minutes)
    run_dir = Path(cfg.run_dir)
    setup_logging(run_dir, env.rank)
    cfg = _resolved(cfg, env.device)
    cfg = pin_hub_revision(cfg, env.decide)  # before any record is read
    configure(env.device, cfg.train.tf32, cfg.train.deterministic, cfg.train.attention_kernel)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if env.device.type == "cpu" and cfg.train.malloc == "keep":
        keep_freed_memory()
    ckpts = CheckpointManager.from_config(run_dir, cfg.checkpoint, env.is_main)
    with startup.phase("checkpoint verify"):
        resume_from = ckpts.resume_point(cfg.checkpoint.resume, env)  # before any work: may refuse
    start = None
    if cfg.init.source is not None:
        cfg, start = _starting_point(cfg, explicit, resume_from, env)
    with startup.phase("tokenizer/data"):
        tok, cache = prepare_data(cfg, env)
    with startup.phase("model build"):
        seed_everything(cfg.train.seed)  # the same initial parameters on every rank
        model = build_model(cfg.model, tok.vocab_size, tok.pad_id)
        if start is not None and resume_from is None:  # before the engine wraps it
            _load_source(model, start, cfg, tok, env)
        frozen = selection.freeze(model, cfg.train.freeze)  # before the optimizer is made
        if frozen and env.is_main:
            log.info("train.freeze: %s values not trained", f"{frozen:,}")
        n_params = count_parameters(model)  # before ZeRO-3 partitions them
        engine = build_engine(
            model, cfg, env, rebuild=lambda: build_model(cfg.model, tok.vocab_size, tok.pad_id)
        )
    if start is not None and resume_from is None and cfg.init.optimizer == "keep":
        with startup.phase("checkpoint load"):
            init_source.load_moments(engine, start.found, cfg)
        start.provenance["reset"] = [r for r in start.provenance["reset"] if r != "optimizer"]
    seed_everything(cfg.train.seed + 1_000_003 * env.rank)  # different dropout on each rank
    with startup.phase("tokenizer/data"):
        loader = make_loader(
            cfg,
            cfg.data.train,
            tok,
            train=True,
            rank=env.rank,
            world_size=env.world_size,
            cache=cache,
            pin_memory=env.device.type == "cuda",
        )
    ckpts.track(cfg, tok, engine, loader, env, start and start.provenance)
    progress = ckpts.restore(resume_from, startup) if resume_from is not None else Progress()
    _log_checksums(env)
    if memory_probe.wanted(cfg.train.memory_probe, env.device, cfg.distributed.zero_stage):
        kind, smoothing = cfg.model.kind, cfg.train.label_smoothing
        with startup.phase("memory probe"):
            memory_probe.probe(
                engine, loader.largest_batches(), kind, smoothing, tok.pad_id, env.device
            )
    if env.is_main:  # after the checks a resume makes: a refused config never replaces it
        cfg.save(run_dir / "config.yaml")
    # Events an interrupted run logged after its last checkpoint are dropped from the curves.
    purge = progress.step + 1 if progress.step else None
    metrics = Metrics(run_dir, env.is_main, cfg.logging.tensorboard, purge_step=purge)
    peak = device_peak_flops(
        env.device,
        cfg.train.precision,
        cfg.logging.peak_tflops,
        tf32=cfg.train.tf32,
        kept=run_dir / "peak_flops.json",
        keep=env.is_main,
    )
    log.info(
        "%s model, %s parameters, vocab %d | %d tokens x %d micro-batches x %d ranks per step | "
        "backend %s, ZeRO stage %d, %s on %s | peak %.3g TFLOP/s | %s schedule, warmup %d, "
        "cooldown %d of %d steps | %s",
        cfg.model.kind,
        f"{n_params:,}",
        tok.vocab_size,
        cfg.train.max_tokens,
        cfg.train.grad_accum,
        env.world_size,
        cfg.distributed.backend,
        cfg.distributed.zero_stage,
        cfg.train.precision,
        env.device,
        peak / 1e12,
        cfg.schedule.kind,
        cfg.schedule.warmup,
        cfg.schedule.cooldown,
        cfg.train.max_steps,
        f"resumed from {resume_from} (step {progress.step})" if resume_from else "new run",
    )
    if "SLURM_JOB_ID" in os.environ:  # a requeued job starts again under the same id
        log.info(
            "Slurm job %s, restart %s",
            os.environ["SLURM_JOB_ID"],
            os.environ.get("SLURM_RESTART_COUNT", "0"),
        )
    if env.is_main:
        _log_launcher()
    use_timeout(cfg.distributed.timeout_minutes, env)  # set-up is done: a lost rank fails fast
    startup.set_up_done()
    measured = not cfg.logging.peak_tflops and (
        datasheet_peak(env.device, cfg.train.precision, cfg.train.tf32) is None
    )
    init = start and start.provenance
    return Run(
        cfg, env, tok, engine, loader, ckpts, metrics, progress, peak, measured, stop, startup, init
    )


@dataclass
class _Start:
    """Where a run with init.source starts: the source's files (None when the run resumes its
    own checkpoint) and what every checkpoint records of it."""

    found: init_source.Located | None
    provenance: dict


def _starting_point(
    cfg: Config, explicit: frozenset[str] | None, resume_from: Path | None, env: DistEnv
) -> tuple[Config, _Start]:
    """init.source's part of a start, in the order checkpoint/init_source.py gives: the
    config with the source's model and tokenizer, and what to load."""
    given, run_dir = cfg.init.source, Path(cfg.run_dir)
    if resume_from is not None:  # the run's own checkpoint wins; the source is not read
        manifest = read_manifest(resume_from, verify=False)  # verified by resume_point
        init_source.check_resumed(given, manifest, resume_from)
        saved = {"given": given, **manifest["config"]}
        cfg, _ = init_source.with_source(cfg, saved, explicit)
        log.info(
            "init.source=%s not loaded: the run resumes its own checkpoint %s", given, resume_from
        )
        return cfg, _Start(None, manifest["init"])

    def resolve():
        found, record = init_source.resolve(given, run_dir)
        merged, notes = init_source.with_source(cfg, record, explicit)
        if cfg.init.vocab == "same":
            init_source.bring_tokenizer(merged, found, record)
        elif found.tokenizer is None:
            raise CheckpointError(
                f"init.vocab=remap maps pieces by string, but the tokenizer {given} was "
                "trained with is not found beside it or at its config's tokenizer.path"
            )
        return found, record, merged, notes

    # Rank 0 resolves, records and copies the tokenizer; every rank gets its answer.
    found, record, cfg, notes = env.decide(resolve)
    if env.is_main:
        init_source.log_start(record, notes)
    return cfg, _Start(found, init_source.summary(record))


def _load_source(model, start: _Start, cfg: Config, tok: Tokenizer, env: DistEnv) -> None:
    """init.source's weights into the plain model, and what that did in the log and record."""
    remap = (Tokenizer(start.found.tokenizer), tok) if cfg.init.vocab == "remap" else None
    counts = init_source.load_weights(model, start.found, cfg.init.exclude, remap)
    start.provenance |= {"exclude": list(cfg.init.exclude), "vocab": cfg.init.vocab, **counts}
    if not env.is_main:
        return
    if cfg.init.exclude:
        log.info("init.exclude: %s values left freshly initialised", f"{counts['fresh']:,}")
    if remap is not None:
        log.info(
            "init.vocab=remap: %d of this tokenizer's %d pieces taken from the source's %d by "
            "string (the 4 specials by role), %d new",
            counts["pieces_kept"],
            tok.vocab_size,
            remap[0].vocab_size,
            counts["pieces_new"],
        )


def _log_launcher() -> None:
    """Which start of the group this is under torchrun, and a warning where plain torchrun's
    restarts would also restart a preempted run, or an error to fix (distributed/run.py)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]
    launcher = os.environ.get(faults.LAUNCHER_ENV, "torchrun")
    log.info("%s: restart %s on this node (at most %d)", launcher, count, restarts)
    if restarts and launcher == "torchrun":
        log.warning(
            "torchrun --max-restarts=%d restarts a preempted run in place, and an error to fix "
            "%d times: launch with `python -m aiayn.distributed.run` (same options), which "
            "restarts faults only (docs/distributed.md)",
            restarts,
            restarts,
        )


def _loop(run: Run) -> dict[str, float]:
    cfg = run.cfg
    with StepBatches(run.loader, cfg.train.grad_accum, cfg.train.max_epochs) as steps:
        try:
            return _train_until_done(run, steps)
        except RuntimeError as exc:
            if run.env.distributed and _is_collective_failure(exc):
                error = _peer_error(run, exc)
                log.error("%s", error)
                raise error from exc
            exc.add_note(f"aiayn: raised on rank {run.env.rank} after step {run.progress.step}")
            raise


def _is_collective_failure(exc: RuntimeError) -> bool:
    """gloo raises a plain RuntimeError naming itself, or its pair ("Application timeout caused
    pair closure", what an operation that timed out reports when it was waited for later);
    NCCL's errors are DistErrors."""
    text = str(exc)
    return isinstance(exc, torch.distributed.DistError) or "gloo" in text or "pair closure" in text


def _peer_error(run: Run, exc: RuntimeError) -> PeerError:
    step, minutes = run.progress.step + 1, run.cfg.distributed.timeout_minutes
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    if "timeout" in first_line.lower() and "timed out" not in first_line.lower():
        first_line = f"timed out: {first_line}"
    latest = run.ckpts.named_latest() or "none (a new run)"
    return PeerError(
        f"step {step}: a collective failed on rank {run.env.rank} ({first_line}). Another "
        f"rank died, or stalled for distributed.timeout_minutes ({minutes:g} min); its log "
        f"says why. The latest checkpoint is {latest}: under "
        "`python -m aiayn.distributed.run --max-restarts=N` the group restarts from it."
    )


def _train_until_done(run: Run, steps: StepBatches) -> dict[str, float]:
    cfg, engine, loader, progress = run.cfg, run.engine, run.loader, run.progress
    validation = None
    if cfg.data.valid:  # on the run's copy of the split: a restart reads no source
        local = with_run_copy(cfg, "valid", run.env.decide)
        validation = Validation(local, run.tok, run.env)
    per_source = _source_validations(cfg, run.tok, run.env)
    if cfg.data.test:  # for `aiayn evaluate`; training does not need it, so it cannot stop it
        try:
            with_run_copy(cfg, "test", run.env.decide)
        except DataError as exc:
            log.warning("%s; `aiayn evaluate --split test` will read the source", exc)
    bar = ProgressBar(cfg.train.max_steps, progress.step, run.env.is_main)
    window, last_eval = Window(), {}
    saved_step, epoch = progress.step, loader.epoch
    while progress.step < cfg.train.max_steps:
        waited = time.perf_counter()
        fetched = steps.next()
        micro = [batch for batch, _ in fetched]
        window.data_seconds += time.perf_counter() - waited
        if loader.epoch != epoch:
            _log_data(loader, f"epoch {epoch} done")
            epoch = loader.epoch
        n_tokens, stop_now, past_limit = _step_totals(run, steps, micro)
        if past_limit:  # stop together when any rank's step reached the limit (data/steps.py)
            steps.give_back()
            break
        if cfg.logging.record_ids:
            _record_ids(run, fetched)
        grad_norm = _train_step(run, micro, window, n_tokens)
        if not run.startup.done:
            _log_startup(run, window.data_seconds)
        step, last = progress.step, progress.step == cfg.train.max_steps
        shown, valid = None, None
        if step % cfg.logging.every_steps == 0 or last:
            shown = _log_window(run, window, grad_norm, bar.bar is None)
            window = Window()
        bar.update(shown)
        if stop_now:
            _stop(run, window, step)
        stop_early = False
        due = (cfg.train.eval_every and step % cfg.train.eval_every == 0) or last
        if validation and due:
            last_eval = valid = validation.run(engine, run.metrics, step, run.env)
            stop_early = _no_longer_improving(cfg, progress, valid) and not last
        for each in per_source if due else ():  # scored and shown; data.valid ranks
            each.run(engine, run.metrics, step, run.env)
        if run.ckpts.due(step) or last or stop_early:
            _save(run, window, step, valid)
            saved_step = step
        if stop_early:
            break
        if window.tokens == 0:  # tokens/s measures training, not validation or saving
            window.started = time.perf_counter()
    run.vote.close()  # the stop vote started by the last step
    if progress.step != saved_step:  # stopped early by max_epochs
        _save(run, window, progress.step)
    run.ckpts.wait(run.env)  # a background write of the last checkpoint
    bar.close()
    _log_data(loader, f"training done at step {progress.step}, epoch {loader.epoch}")
    hparams = cfg.to_dict()
    if run.init:  # the source as given, and where it resolved
        hparams["init"] = {**hparams["init"], **run.init}
    run.metrics.hparams(hparams, {f"valid_{k}": v for k, v in last_eval.items()}, progress.step)
    if cfg.train.finish and run.env.is_main:  # the averaged model: one process's work
        finish(cfg.run_dir, cfg.train.finish, cfg.train.finish_select)
    return last_eval


def _source_validations(cfg: Config, tok: Tokenizer, env: DistEnv) -> list[Validation]:
    """A Validation of each data.sources entry's own dev set (on the run's copy of it), logged
    as valid_<name>/...: untagged, like data.valid and inference."""
    out = []
    for source in (s for s in cfg.data.sources if s.valid):
        name = f"{PREFIX}_{source.name}"
        local = with_run_copy(as_train(cfg, source), "valid", env.decide, name=name)
        out.append(Validation(local, tok, env, prefix=name))
    return out


def _no_longer_improving(cfg: Config, progress: Progress, valid: dict[str, float]) -> bool:
    """Count this validation for train.patience (in `progress`, which the checkpoint holds);
    True when the run should stop. Every rank decides alike: it sees the same scores (summed
    over the ranks, or rank 0's broadcast)."""
    metric, delta = cfg.checkpoint.best_metric, cfg.train.patience_delta
    value = valid.get(metric.removeprefix(f"{PREFIX}/"), float("nan"))
    best = progress.best_value
    if math.isfinite(value) and (
        best is None or (value - best if cfg.checkpoint.higher_is_better else best - value) > delta
    ):
        progress.best_value, progress.best_step, progress.since_best = value, progress.step, 0
        return False
    progress.since_best += 1
    if not cfg.train.patience or progress.since_best < cfg.train.patience:
        return False
    log.info(
        "early stop at step %d: %s has not improved by more than %g in %d validations; its "
        "last improvement was to %.6g at step %d",
        progress.step,
        metric,
        delta,
        progress.since_best,
        best if best is not None else float("nan"),
        progress.best_step,
    )
    return True


def _step_totals(run: Run, steps: StepBatches, micro: list) -> tuple[int, bool, bool]:
    """The step's target tokens on all ranks, whether any rank was asked to stop, and whether
    any rank's step reached train.max_epochs. From the token cache's plan, which every rank
    knows whole, the first and the last need no collective, and the stop is agreed without
    waiting (StopVote). Streaming, each rank knows its own batches only: one collective of
    host numbers, which waits for no device (DistEnv.sum)."""
    known = steps.group_totals()
    if known is not None:
        tokens, past = known
        return tokens, run.vote.agreed(), past
    here = [sum(b.n_tokens for b in micro), float(run.stop.requested), float(steps.past_limit())]
    tokens, stops, past = run.env.sum(here)
    return int(tokens), stops > 0, past > 0


def _train_step(run: Run, micro: list, window: Window, n_tokens: int) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches, of `n_tokens` targets on all ranks;
    returns the gradient norm. Nothing here waits for the device (but fp16's loss scaler, in
    engine.step): what the step needs from the other ranks is reduced before it
    (_step_totals), and what it logs stays on the device until a log line (Window)."""
    cfg, engine = run.cfg, run.engine
    engine.train()
    for i, batch in enumerate(micro):
        window.flops += training_flops(cfg.model, run.tok.vocab_size, batch)
        batch = batch.to(run.env.device)
        with engine.accumulating(last=i == len(micro) - 1):
            with engine.autocast():
                loss, correct = batch_loss(
                    engine.model, batch, cfg.model.kind, cfg.train.label_smoothing, run.tok.pad_id
                )
            # Dividing by the step's tokens on all ranks, not the micro-batch's, makes
            # accumulation and data parallelism compute the same update as one big batch.
            engine.backward(loss / max(n_tokens, 1))
        window.add(loss, correct, batch.n_tokens)
    run.ckpts.before_update()  # an async save may still be copying the weights it changes
    grad_norm = engine.step()
    run.progress.step += 1
    run.progress.tokens += n_tokens
    window.steps += 1
    return grad_norm


def _log_checksums(env: DistEnv) -> None:
    """What checksums read at this start, summed over the ranks: verifying the checkpoint and
    the token cache, about one of each however many ranks (one verifies for all); at a first
    start also the corpus a cache build read, each file or range hashed by the rank that read
    it, and the arrays rank 0 wrote."""
    hashed = bytes_hashed()
    total, ranks = env.sum([float(hashed), float(hashed > 0)])
    if total:
        log.info(
            "checksums at start: %s bytes hashed by %d of %d rank(s)",
            f"{int(total):,}",
            ranks,
            env.world_size,
        )


def _log_startup(run: Run, first_batch_wait: float) -> None:
    """The start-up line, once this process's first step is over: on a restart, the time a
    fault cost from this process's creation on (aiayn/startup.py)."""
    if run.env.device.type == "cuda":
        torch.cuda.synchronize(run.env.device)  # once: the first step has run, not only queued
    line, split = run.startup.first_step_done(first_batch_wait)
    log.info("%s", line)
    names = {name: "startup_s/" + name.replace(" ", "_").replace("/", "_") for name in split}
    run.metrics.scalars({names[k]: v for k, v in split.items()}, run.progress.step)


def _stop(run: Run, window: Window, step: int) -> None:
    """Preemption: every rank saves this step, then raises Preempted (exit code 75)."""
    _save(run, window, step)
    run.ckpts.wait(run.env)
    waited = time.monotonic() - run.stop.received_at if run.stop.requested else 0.0
    source = f"{waited:.2f}s after the signal" if run.stop.requested else "signal on another rank"
    log.warning(
        "stop requested: saved step %d (%s); exiting with %d: checkpointed, requeue me",
        step,
        source,
        REQUEUE_EXIT_CODE,
    )
    raise Preempted(step, waited)


def _record_ids(run: Run, fetched: list) -> None:
    path = Path(run.cfg.run_dir) / "consumed" / f"rank_{run.env.rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for batch, epoch in fetched:
            row = {"step": run.progress.step + 1, "epoch": epoch, "ids": batch.ids.tolist()}
            if batch.sources is not None:  # a mixture: ids count within each source
                row["sources"] = batch.sources.tolist()
            fh.write(json.dumps(row) + "\n")


def _log_data(loader: BatchLoader | CachedLoader, when: str) -> None:
    """What the loader read and dropped, so a filtered corpus never goes unnoticed."""
    stats = loader.stats()
    log.info("%s | data: %s", when, ", ".join(f"{k} {v}" for k, v in stats.items()))
    dropped = stats["dropped_too_long"] + stats["dropped_empty"] + stats["invalid_utf8_skipped"]
    if dropped > 0.05 * max(stats["examples_read"], 1):
        log.warning(
            "%d of %d examples were dropped: see data.max_len and the corpus",
            dropped,
            stats["examples_read"],
        )


def _log_window(run: Run, window: Window, grad_norm, console: bool) -> dict[str, float]:
    """One host sync per log line: the window's sums come off the device together."""
    step, progress = run.progress.step, run.progress
    loss_sum, correct, tokens, flops = run.env.sum(
        [float(window.loss), float(window.correct), window.tokens, window.flops]
    )
    if not math.isfinite(loss_sum):
        raise TrainingError(
            f"the training loss became {loss_sum} before step {step}. No checkpoint holds these "
            "weights. Lower the learning rate (schedule.factor), set train.clip_norm (e.g. 1.0), "
            "or use train.precision=fp32, then re-run: it resumes from the last good checkpoint."
        )
    elapsed = max(time.perf_counter() - window.started, 1e-9)
    loss = loss_sum / max(tokens, 1)
    scalars = {
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
        "accuracy": correct / max(tokens, 1),
        "lr": run.engine.lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": tokens / elapsed,  # all ranks
        "step_time_s": elapsed / max(window.steps, 1),
        "data_wait_fraction": window.data_seconds / elapsed,  # rank 0's
        "mfu": flops / elapsed / (_peak(run, flops / elapsed) * run.env.world_size),
        "memory_gib": memory_bytes(run.env.device) / 2**30,
        **cuda_memory(run.env.device),
        "loss_scale": run.engine.loss_scale,
        "skipped_steps": run.engine.skipped_steps,
        "tokens": progress.tokens,
    }
    run.metrics.log("train", step, scalars, console=console)
    if isinstance(run.loader, MixedLoader | MixedStream):  # what the group took of each source
        run.metrics.log("data", step, run.loader.mixture_scalars(), console=False)
    return {k: scalars[k] for k in ("loss", "lr", "tokens_per_s")}


def _peak(run: Run, achieved: float) -> float:
    """The peak MFU counts against. A measured one (CPU) was taken once, at the run's first
    start, maybe under load; when training outruns it, it was too low, and the rate training
    reached is the better estimate from then on (kept for restarts): so MFU never exceeds 1."""
    per_rank = achieved / run.env.world_size
    if run.peak_measured and per_rank > run.peak_flops:
        log.warning(
            "training reached %.3g TFLOP/s per rank, above the %.3g TFLOP/s measured as this "
            "device's peak at the run's first start (measured under load?): MFU counts against "
            "the rate reached from here on",
            per_rank / 1e12,
            run.peak_flops / 1e12,
        )
        run.peak_flops = per_rank
        if run.env.is_main:
            raise_kept_peak(Path(run.cfg.run_dir) / "peak_flops.json", per_rank)
    return run.peak_flops


def _save(run: Run, window: Window, step: int, valid: dict[str, float] | None = None) -> None:
    """Checkpoint `step`, never from weights a non-finite loss has touched (on any rank)."""
    if not math.isfinite(run.env.sum([float(window.loss)])[0]):
        latest = run.ckpts.named_latest()
        raise TrainingError(
            f"non-finite training loss before step {step}; not saving. The last good checkpoint "
            f"is {latest or 'none'}. Lower schedule.factor or set train.clip_norm, then re-run."
        )
    run.ckpts.save_step(step, run.progress, valid)  # a failed save is retried at the next one
    failed = {"failed_saves": len(run.ckpts.failures.steps)}  # in a row, up to max_failed_saves
    run.metrics.log("checkpoint", step, failed, console=False)
    run.metrics.flush()  # the curves up to a checkpoint survive a crash with it
