"""How a run is carried out around the training loop: the `distributed` section (DDP or
DeepSpeed ZeRO), `init` (starting from a trained model's weights), `checkpoint` (what is saved,
kept and resumed, ranked by which validation metric) and `logging`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from aiayn import metric_names
from aiayn.config.checks import Section, bounded, suggest


@dataclass
class FSDPConfig(Section):
    reshard_after_forward: bool = True
    """True: each layer's parameters are freed after its forward and gathered again for its
    backward (ZeRO-3's memory: a rank holds 1/W of them between uses); false: kept gathered
    from the forward to the backward (ZeRO-2's speed: one gather a step fewer, the whole
    layer's weights held meanwhile). The default is the memory, which is why a user shards."""
    offload: bool = False
    """Parameters, gradients and the optimizer step on the CPU (FSDP2's CPUOffloadPolicy),
    copied to the device for each layer's use."""


@dataclass
class DistributedConfig(Section):
    backend: str = "ddp"
    """The engine (engine/registry.py; docs/distributed.md compares them): ddp, PyTorch
    DistributedDataParallel (also the single-process path); deepspeed, DeepSpeed ZeRO (the
    options zero_stage to deepspeed_config); fsdp, PyTorch's FSDP2 (`fully_shard`, the
    options of distributed.fsdp)."""
    zero_stage: int = bounded(0, low=0, high=3)
    """deepspeed: the ZeRO stage: 0 none, 1 optimizer states, 2 also gradients, 3 also parameters
    are partitioned across data-parallel ranks."""
    offload_optimizer: bool = False
    """ZeRO-Offload (stage >= 1): optimizer state and step on the CPU (DeepSpeedCPUAdam)."""
    offload_params: bool = False
    """ZeRO-3 parameter offload to the CPU."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of storing them."""
    deepspeed_config: str | None = None
    """A JSON file of extra DeepSpeed keys (e.g. configs/deepspeed/*.json) merged into the
    config generated from this one; a key that contradicts the generated value is an error,
    but under timers, wall_clock_breakdown and steps_per_print (DeepSpeed's reports about
    itself, off in the generated config: its timers wait for the GPU), where the file wins."""
    setup_timeout_minutes: float = bounded(120.0, low=0, low_open=True)
    """How long a collective may wait until set-up is done (tokenizer training on rank 0,
    building the token cache, building the model, restoring a checkpoint). Longer than
    training's: rank 0 trains the tokenizer of a WMT-size corpus while the others wait."""
    first_step_timeout_minutes: float = bounded(10.0, low=0, low_open=True)
    """How long a collective may wait in the first step of each start, once set-up is done:
    with train.compile every rank compiles the model there, and a rank whose compile cache is
    cold (a new node) finishes minutes after the others."""
    timeout_minutes: float = bounded(1.0, low=0, low_open=True)
    """How long a collective may wait after the first step: after a rank died or hung, or its
    node was lost, the others stop with an error this long after, and the launcher restarts
    the group (docs/distributed.md, "Faults and restarts": with the launcher's defaults a lost
    node is given up within 2 minutes). Keep it above the longest stretch in which one rank
    waits for another: a rank's part of a synchronous save, validation's slowest share."""


@dataclass
class InitConfig(Section):
    source: str | None = None
    """Start this run from a trained model's weights (fine-tuning, or continuing with new
    settings): a run directory (its latest valid checkpoint; RUN/best, RUN/latest and
    RUN/averaged name those), a checkpoint step directory, a checkpoint's moving average of
    the weights (train.ema: RUN/ema, CKPT/ema), an averaged model (aiayn average,
    aiayn finish), a FILE.safetensors written by aiayn export or aiayn import-hf, or a Hugging
    Face MarianMT (OPUS-MT) directory or hub name, imported once into run_dir/init_source/ at
    the first start (docs/fine_tuning.md#opus-mt). The weights only: the step,
    schedule, data position, random state, best ranking and loss scale start fresh, and
    train.max_steps counts this run's steps. The model's shape-defining fields and the
    tokenizer come from the source (a model field set here to another value is an error);
    dropout and everything outside model come from this config. Recorded in run_dir at the
    first start (init_source.json): a restart before the first save starts again from that same
    checkpoint, checked by its sha256; after it, the run resumes its own checkpoints
    (docs/fine_tuning.md)."""

    optimizer: Literal["reset", "keep"] = "reset"
    """reset: Adam starts afresh, as in any new run. keep: Adam's moments and step count come
    from the source, which must then be a training checkpoint (not an averaged model or an
    export) of a run that trained the same parameters (train.freeze), with the same
    vocabulary and nothing excluded: the run continues the source's optimization with its own
    schedule, data and steps."""
    vocab: Literal["same", "remap"] = "same"
    """same: the source's tokenizer, copied into the run (a tokenizer.path naming another is an
    error listing the fields that differ). remap: this run's own tokenizer (tokenizer.path, or
    trained from data.train as a new run's is), with the rows of every vocabulary matrix (the
    embeddings, an untied output projection; a tied matrix once) copied from the source by
    piece string, the specials by role, and pieces the source lacks initialised as a new
    model's; the counts are logged and recorded."""
    exclude: list[str] = field(default_factory=list)
    """Parameters left as this run initialises them instead of taken from init.source, by name
    glob (fnmatch), e.g. ["decoder.*"]. Each glob must match a parameter of the model; a tied
    matrix is left fresh if any of its names matches."""

    def validate(self) -> list[str]:
        errs = []
        if self.source is not None and not self.source.strip():
            errs.append("init.source is empty: name a run directory, a checkpoint or an export")
        for key, value in (
            ("exclude", self.exclude),
            ("vocab", self.vocab != "same"),
            ("optimizer", self.optimizer != "reset"),
        ):
            if value and self.source is None:
                errs.append(f"init.{key} says how to start from init.source: set init.source")
        if self.optimizer == "keep" and (self.exclude or self.vocab == "remap"):
            errs.append(
                "init.optimizer=keep continues the source's Adam state for every parameter as it "
                "was: not with init.exclude or init.vocab=remap, which change parameters; set "
                "init.optimizer=reset"
            )
        return errs


# Validation metrics a checkpoint records (TensorBoard tags), and whether higher is better.
VALID_METRICS = metric_names.VALID_TAGS


@dataclass
class CheckpointConfig(Section):
    every_steps: int = bounded(1000, low=1)
    """Save every this many optimizer steps (and at the end)."""
    keep_last: int = bounded(5, low=1)
    """Keep this many most recent checkpoints."""
    keep_every: int = bounded(0, low=0)
    """Also keep every checkpoint whose step is a multiple of this, e.g. for averaging or to go
    further back than keep_last; 0: off. A multiple of every_steps."""
    keep_best: int = bounded(0, low=0)
    """Also keep this many checkpoints with the best best_metric; 0: off. Only checkpoints saved
    at a validation step record the metric, so train.eval_every must be a multiple of
    every_steps."""
    best_metric: str = "valid/loss"
    """What keep_best ranks by: valid/loss, valid/ppl, valid/accuracy; valid/bleu,
    valid/bleu_lc, valid/chrf or valid/ter (seq2seq, unless train.eval_bleu is 0); valid/bpc or
    valid/word_ppl (lm with data.unit characters or words)."""
    best_mode: Literal["auto", "min", "max"] = "auto"
    """min: lower is better; max: higher is better; auto: max for accuracy, BLEU and chrF, min
    for loss, perplexity, TER, bpc and word perplexity."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest valid checkpoint in run_dir; never: refuse a run_dir that
    already holds checkpoints rather than overwrite it."""
    async_save: bool = False
    """Write checkpoints in a background thread: training waits only while the state is copied
    into host memory (one extra copy of weights and optimizer state while a write is in
    flight). ZeRO shards are still written by DeepSpeed before training goes on."""
    max_failed_saves: int = bounded(3, low=1)
    """Stop (exit code 2) after this many failed saves in a row, e.g. on a full disk. A failed
    save loses nothing (the previous checkpoint stays `latest`) and training goes on to retry at
    the next save, so at most this many x every_steps steps of work are at risk. The last save
    of a run, or a preemption's, always stops the run when it fails."""

    @property
    def higher_is_better(self) -> bool:
        if self.best_mode == "auto":
            return VALID_METRICS.get(self.best_metric, False)
        return self.best_mode == "max"

    def validate(self) -> list[str]:
        errs = []
        if self.keep_every > 0 and self.every_steps >= 1 and self.keep_every % self.every_steps:
            errs.append(
                f"checkpoint.keep_every ({self.keep_every}) must be a multiple of "
                f"checkpoint.every_steps ({self.every_steps}): no other step is saved"
            )
        if self.best_metric not in VALID_METRICS:
            errs.append(
                f"checkpoint.best_metric {self.best_metric!r} is not recorded; choose from "
                f"{sorted(VALID_METRICS)}" + suggest(self.best_metric, VALID_METRICS)
            )
        return errs


@dataclass
class LoggingConfig(Section):
    every_steps: int = bounded(50, low=1)
    """Console and TensorBoard scalars every this many optimizer steps."""
    tensorboard: bool = True
    """Write TensorBoard events into <run_dir>/tb."""
    samples: int = bounded(3, low=0)
    """Source / reference / hypothesis triples shown at each validation (seq2seq)."""
    record_ids: bool = False
    """Append the example ids of every batch each rank trains on to
    <run_dir>/consumed/rank_<r>.jsonl (to audit what a run has seen, e.g. across a resume)."""
    peak_tflops: float | None = bounded(None, low=0, low_open=True)
    """The device's peak TFLOP/s for MFU. None: a GPU's data sheet, or a matmul measured at start
    on CPU (and on GPUs without a known figure)."""
