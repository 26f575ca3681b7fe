"""How the model is trained: the `optim` section (Adam), the `schedule` section (the learning
rate over the steps) and the `train` section (steps, batches, regularisation, validation,
precision and kernels)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from aiayn.config.checks import Section, bounded
from aiayn.errors import ConfigError


@dataclass
class OptimConfig(Section):
    name: Literal["adam", "adamw"] = "adam"
    """Adam as in §5.3; adamw decouples weight decay."""
    betas: list[float] = bounded(default_factory=lambda: [0.9, 0.98], low=0, high=1, high_open=True)
    """Adam beta_1, beta_2 (§5.3)."""
    eps: float = bounded(1e-9, low=0, low_open=True)
    """Adam epsilon (§5.3)."""
    weight_decay: float = bounded(0.0, low=0)
    """L2 (adam) or decoupled (adamw) weight decay."""

    def validate(self) -> list[str]:
        if len(self.betas) != 2:
            return [f"optim.betas must be two numbers (beta_1, beta_2), got {self.betas}"]
        return []


@dataclass
class ScheduleConfig(Section):
    kind: Literal["noam", "constant"] = "noam"
    """noam: factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (§5.3); constant: lr."""
    warmup: int = bounded(4000, low=1)
    """Optimizer steps of linear warmup (§5.3)."""
    factor: float = bounded(1.0, low=0, low_open=True)
    """Multiplier on the noam rate (the paper uses 1)."""
    lr: float = bounded(1e-4, low=0, low_open=True)
    """Learning rate of the constant schedule."""
    cooldown: int | None = bounded(
        None, low=0, wrong_type="a share of train.max_steps is schedule.cooldown_fraction"
    )
    """The last this many optimizer steps before train.max_steps scale the rate down linearly
    to 0 (None or 0: none, the paper's schedule to the end). For a run whose length is fixed in
    advance: a rate that falls to zero ends lower than one cut off while still high. Counted
    from max_steps: a run that train.max_epochs stops first ends before it."""
    cooldown_fraction: float | None = bounded(None, low=0, low_open=True, high=1)
    """The cooldown as a share of train.max_steps instead (0.2: the last 20% of the steps),
    so that it scales with an override of max_steps (torchtitan's decay_ratio). Rounded to the
    nearest step, at least 1; the run's config.yaml records the steps as schedule.cooldown.
    Give one of the two. The key, not the number's form, says which is meant: cooldown_fraction
    1 is the whole run, cooldown 1 one step, and cooldown 0.2 is refused, not truncated."""

    def cooldown_steps(self, max_steps: int) -> int:
        """The cooldown in optimizer steps for a run of `max_steps` steps."""
        if self.cooldown_fraction is None:
            return self.cooldown or 0
        # Half up rather than Python's round-half-even, and never 0: a fraction asks for some.
        return max(1, math.floor(self.cooldown_fraction * max_steps + 0.5))

    def in_steps(self, max_steps: int) -> ScheduleConfig:
        """This schedule with its cooldown resolved to steps, as a run records it."""
        cooldown = self.cooldown_steps(max_steps)
        return dataclasses.replace(self, cooldown=cooldown, cooldown_fraction=None)

    def validate(self) -> list[str]:
        if self.cooldown is not None and self.cooldown_fraction is not None:
            return [
                f"schedule.cooldown ({self.cooldown}) and schedule.cooldown_fraction "
                f"({self.cooldown_fraction}) are both set: give the cooldown in steps or as a "
                "fraction of train.max_steps, and set the other to null (an override: "
                "schedule.cooldown_fraction=null or schedule.cooldown=null)"
            ]
        return []


@dataclass
class TrainConfig(Section):
    max_steps: int = bounded(100_000, low=1)
    """Optimizer steps to train for."""
    max_epochs: int | None = bounded(None, low=1)
    """Stop after this many passes over the training data, if earlier than max_steps."""
    seed: int = 1
    """Seeds parameters, dropout and data order."""
    max_tokens: int = bounded(4096, low=1)
    """Tokens of the largest forward (padding included), like fairseq --max-tokens: what a
    rank's memory allows. Without train.unit_tokens it is also the batch plan's unit: each
    planned batch is one forward."""
    tokens_per_step: int | None = bounded(None, low=1)
    """The optimizer step's token budget over all ranks, counted as max_tokens counts (the
    paper's ~25,000): tokens_per_step / unit_tokens planned batches (units) a step, shared out
    among the ranks, each rank accumulating its share. The batch, and so what the schedule's
    steps mean, is the same on any number of GPUs, and a run resumed on another world size
    keeps it. It must be a whole number of units (never rounded: a rounded batch is another
    optimisation), and any world size up to that number shares them: where it does not divide
    them, some ranks take one more and the others idle for it (the start-up line says how
    much). Step k takes the same examples at every world size. None: train.grad_accum
    decides."""
    unit_tokens: int | None = bounded(None, low=1)
    """The batch plan's unit (needs train.tokens_per_step): the data is planned in batches of
    at most this many tokens, a step is tokens_per_step / unit_tokens of them, and a rank
    fuses the units it takes into forwards of up to train.max_tokens (where max_tokens is at
    least twice the unit: units of similar widths together, the fewest forwards that fit). The
    plan then depends on neither the world size nor max_tokens: any world size up to the
    step's units trains the same examples in step k, and max_tokens (the forward, what memory
    allows) may change at a resume. Choose it so that the GPU counts you use divide the step's
    units (the WMT configs: 24,576 / 384 = 64, for 1 to 64 GPUs), and no smaller than a long
    example's width. None: max_tokens (each unit one forward; the plan changes with
    max_tokens)."""
    grad_accum: int | None = bounded(None, low=1)
    """Micro-batches each rank accumulates per optimizer step (None: 1, or derived from
    train.tokens_per_step); the schedule steps once per optimizer step. The batch then grows
    with the world size: max_tokens x grad_accum x ranks. Give this or tokens_per_step."""
    clip_norm: float = bounded(0.0, low=0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    label_smoothing: float = bounded(0.1, low=0, high=1, high_open=True)
    """epsilon_ls of §5.4."""
    eval_every: int = bounded(1000, low=0)
    """Validate every this many optimizer steps (0: only at the end)."""
    eval_batches: int | None = None
    """Validate on at most this many batches (None: the whole validation split). An lm scores
    the first this many batches of windows, and then reports no per-character or per-word
    figure, which needs the whole text."""
    eval_bleu: int | None = bounded(None, low=0)
    """seq2seq: the validation sentences translated and scored (BLEU, chrF, TER) at each
    validation, the first this many; None: the whole dev set, shared out among the ranks;
    0: none."""
    patience: int = bounded(0, low=0)
    """Stop the run after this many validations in a row without an improvement of
    checkpoint.best_metric (in the direction checkpoint.best_mode gives) by more than
    patience_delta; 0: never. An equal score or a NaN is no improvement. The run saves, says
    why and at which step the best was, and exits 0; the count is in the checkpoint, so a
    resumed run stops where an uninterrupted one would. One metric decides: best_metric."""
    patience_delta: float = bounded(0.0, low=0)
    """The least change of best_metric that counts as an improvement for train.patience."""
    finish: int = bounded(0, low=0)
    """At the end of the run (max_steps, max_epochs or an early stop), average this many
    checkpoints into run_dir/averaged and score it on the dev and test sets, with a summary
    (`aiayn finish`); 0: off."""
    finish_select: Literal["last", "best"] = "last"
    """Which checkpoints train.finish averages: the newest, or the best by
    checkpoint.best_metric."""
    eval_stride: int | None = bounded(None, low=1)
    """lm: validation and `aiayn evaluate` score the whole text in windows of data.max_len
    tokens. None: non-overlapping windows; s: windows advance by s tokens and score their last
    s, so each token has at least data.max_len - s tokens of context (slower by
    data.max_len / s)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto picks CUDA when present."""
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    """bf16 and fp16 run the forward pass under autocast; weights and optimizer stay fp32.
    fp16 adds dynamic loss scaling (a step whose gradients overflow is skipped); it is meant
    for GPUs without bf16. auto: bf16 where the device multiplies bf16 natively (a GPU with
    bf16; a CPU with AVX512-BF16 or AMX), else fp16 on a GPU with fp16 tensor cores (V100,
    T4), else fp32 (precision.py)."""
    loss_scale_init: float = bounded(2.0**16, low=1)
    """fp16's first loss scale, a power of two (torch's and DeepSpeed's default, 2^16).
    Dynamic scaling halves it at each overflow, skipping that step (train/loss_scale and
    train/skipped_steps show it), and doubles it after 2000 (torch) or 1000 (DeepSpeed) steps
    without one; a smaller start skips fewer of the first steps."""
    threads: int | None = None
    """torch intra-op threads on CPU (None: torch's default)."""
    malloc: Literal["keep", "system"] = "keep"
    """Training on CPU, keep: freed host memory stays in the process for the next step's
    tensors instead of going back to the OS and being page-faulted in again (glibc only; faster,
    see "Measurements behind defaults" in benchmarks/README.md); system: the C library's own
    policy, which returns memory between steps."""
    freeze: list[str] = field(default_factory=list)
    """Parameters not trained, by name glob (fnmatch: * matches dots too), e.g.
    ["*embed*"] or ["encoder.*"]: they keep their values and get no optimizer state. Each glob
    must match a parameter of the model (`aiayn.model.selection`); for fine-tuning from
    init.source above all."""
    compile: bool = False
    """torch.compile each encoder and decoder layer (TorchInductor), fusing its norms,
    residuals, dropout and activations. For GPUs: on a 2-core CPU it was slower
    (benchmarks/README.md). The first steps compile for a minute or more; batch and sequence
    sizes are compiled dynamic, so new batch shapes reuse the graphs (parallelize.py), and a
    layer that would still need more than its budget of graphs stops the run instead of
    silently running uncompiled."""
    tf32: bool = True
    """On CUDA, fp32 matrix multiplies (precision fp32, and the fp32 parts of bf16 and fp16
    runs) use TF32 tensor cores: 10 mantissa bits in the products, fp32 sums, several times
    fp32's throughput (runtime/torch_settings.py). No effect on CPU."""
    deterministic: bool = False
    """Make GPU kernels deterministic, so that a resumed run repeats the killed one bit for bit
    on the same GPUs: torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, Inductor's
    deterministic mode, no cuDNN attention. Costs speed (docs/gpu.md); an operation without a
    deterministic kernel stops the run with torch's error naming it. On CPU the kernels
    already are: a run with the same settings on the same machine repeats without it."""
    attention_kernel: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    """On CUDA, the fused kernel attention may use: auto is the memory-efficient kernel, the
    fastest measured at translation lengths (transformer_big on an H200: 31.5% MFU, against
    29.0% with flash allowed beside it, 28.2% with cuDNN's, torch's own first choice on
    Hopper, and 24.9% with flash alone; benchmarks/README.md). Another value allows that kernel
    alone. Each falls back to torch's math path where it does not apply (flash takes no
    padding mask). mfu.py --attention-kernels compares them on a GPU. No effect on CPU."""
    ema: float | None = bounded(None, low=0, high=1, high_open=True)
    """Keep an exponential moving average of the weights: after every optimizer step
    ema = ema * d + w * (1 - d), in fp32, beside the model (under ZeRO-3 each rank the EMA of
    its own partition); d is this decay, or train.ema_warmup's where lower. None: off. Marian
    smooths with 1e-4 per step (decay 0.9999), fairseq's --ema-decay is 0.9999; a short run
    wants less (0.999). Each checkpoint holds it as ema.safetensors beside model.safetensors,
    and a resume restores it bit for bit; `RUN/ema` (also RUN/best/ema, CKPT/ema) names those
    weights to evaluate, translate, export and init.source. A resume from a checkpoint without
    one starts it from the weights resumed. Costs one fp32 copy of each rank's share of the
    weights."""
    ema_warmup: bool = True
    """With train.ema, update t (from 0) uses the decay min(train.ema, (1 + t) / (10 + t)), as
    Marian's exponential smoothing and TensorFlow's ExponentialMovingAverage(num_updates) do:
    early in a run the average follows the recent weights instead of keeping the random
    initial ones (decay 0.999 alone keeps 22% of them after 1,500 steps). The decay reaches
    0.999 at update 8,990 and 0.9999 at 89,990. false: train.ema from the first update."""
    ema_validate: bool = False
    """Validate the EMA of the weights instead of the weights themselves (needs train.ema):
    the validation scores, checkpoint.best_metric's ranking (so RUN/best is the checkpoint
    whose EMA scored best: use RUN/best/ema) and train.patience all follow the EMA. Training
    is unchanged: the weights are swapped back bit for bit after each validation."""
    memory_probe: Literal["auto", "always", "never"] = "auto"
    """Before the first step (of a new or resumed run), one forward and backward pass of the
    epoch's largest batch, gradients then dropped and no random state moved, so that an
    out-of-memory error comes in the first minute rather than hours in; it logs the peak
    memory. auto: on CUDA only (always: on CPU too). Training is the same with it or without."""

    def unit(self) -> int:
        """The batch plan's unit in tokens: train.unit_tokens, else train.max_tokens."""
        return self.unit_tokens or self.max_tokens

    def unit_names(self) -> tuple[str, str]:
        """The setting that gives the unit, and what messages call its batches."""
        return ("unit_tokens", "units") if self.unit_tokens else ("max_tokens", "micro-batches")

    def fuses(self) -> bool:
        """Whether a rank fuses the units it takes into larger forwards: where a forward holds
        two units or more. Else each unit is one forward, in the order the plan deals them."""
        return self.max_tokens >= 2 * self.unit()

    def step_units(self, world_size: int) -> int:
        """The optimizer step's planned batches (units) over all `world_size` ranks."""
        if self.tokens_per_step is None:
            return (self.grad_accum or 1) * world_size
        return self.tokens_per_step // self.unit()  # a whole number: validate()

    def accumulation(self, world_size: int) -> int:
        """The most units one of `world_size` ranks takes per optimizer step: its share of the
        step's, the larger share where the world size does not divide them (a rank with fewer
        repeats its last forward with weight 0: every rank runs the same collectives). Without
        fusing, each rank's forwards a step. A ConfigError where there are fewer units than
        ranks."""
        units = self.step_units(world_size)
        if units < world_size:
            raise ConfigError(
                _unshared(self.tokens_per_step, self.unit(), world_size, self.unit_names())
            )
        return -(-units // world_size)

    def idle(self, world_size: int) -> float:
        """The share of the ranks' units a step that are a repeat with weight 0."""
        return 1 - self.step_units(world_size) / (self.accumulation(world_size) * world_size)

    def sharing(self, world_size: int) -> str:
        """How the ranks share a step's units: "2 accumulated x 4 ranks per step", or where the
        world size does not divide them "8 shared by 3 ranks (2 take 3, 1 takes 2; 11% of the
        ranks' forwards idle)"; fusing, "64 shared by 8 ranks (8 each), fused into forwards of
        up to 3,072 tokens"."""
        units, most = self.step_units(world_size), self.accumulation(world_size)
        fused = f", fused into forwards of up to {self.max_tokens:,} tokens"
        if units == most * world_size:
            if self.fuses():
                return f"{units} shared by {world_size} ranks ({most} each){fused}"
            return f"{most} accumulated x {world_size} ranks per step"
        more = units - (most - 1) * world_size  # the ranks that take `most`

        def take(n: int) -> str:
            return "takes" if n == 1 else "take"

        fewer, idle = world_size - more, f"{self.idle(world_size):.0%}"
        what, after = ("units", fused) if self.fuses() else ("forwards", "")
        return (
            f"{units} shared by {world_size} ranks ({more} {take(more)} {most}, {fewer} "
            f"{take(fewer)} {most - 1}; {idle} of the ranks' {what} idle){after}"
        )

    def batch(self, world_size: int) -> str:
        """The step as the start-up line says it: "600-token micro-batches x 2 accumulated x 4
        ranks per step", "384-token units x 64 shared by 8 ranks (8 each), fused into ..."."""
        return f"{self.unit():,}-token {self.unit_names()[1]} x {self.sharing(world_size)}"

    def step_tokens(self, world_size: int) -> int:
        """The optimizer step's token budget over `world_size` ranks."""
        return self.unit() * self.step_units(world_size)

    def validate(self) -> list[str]:
        problems = []
        if self.ema_validate and self.ema is None:
            problems.append(
                "train.ema_validate=true validates the moving average of the weights, and "
                "train.ema is off: set train.ema to a decay (e.g. train.ema=0.999), or "
                "train.ema_validate=false"
            )
        return problems + self._batch_problems()

    def _batch_problems(self) -> list[str]:
        per_step = self.tokens_per_step
        if per_step is None:
            if self.unit_tokens is None:
                return []
            return [
                f"train.unit_tokens ({self.unit_tokens}) plans a step of train.tokens_per_step "
                "in units, and tokens_per_step is not set: set it (the paper's batch: "
                "train.tokens_per_step=24576), or train.unit_tokens=null"
            ]
        if self.grad_accum is not None:
            return [
                f"train.tokens_per_step ({per_step}) and train.grad_accum ({self.grad_accum}) "
                "are both set: tokens_per_step fixes the batch over all ranks and derives each "
                "rank's accumulation from the world size; give one and set the other to null "
                "(an override: train.grad_accum=null)"
            ]
        unit, (name, what) = self.unit(), self.unit_names()
        if self.unit_tokens is not None and self.unit_tokens > self.max_tokens:
            return [
                f"train.unit_tokens ({self.unit_tokens}) is larger than train.max_tokens "
                f"({self.max_tokens}), the largest forward: a unit must fit in one. Raise "
                "max_tokens, or lower unit_tokens (a new plan: a new run, not a resume)"
            ]
        if per_step % unit:
            micro = per_step / unit
            below, above = max(1, math.floor(micro)), math.ceil(micro)
            return [
                f"train.tokens_per_step ({per_step}) is {micro:.2f} {what} of "
                f"train.{name} ({unit}): it must be a whole number. Set tokens_per_step to "
                f"{below * unit} ({below}) or {above * unit} ({above}), or {name} to a "
                "divisor of it: " + ", ".join(map(str, _divisors_up_to(per_step, unit, 3)))
            ]
        return []


def _divisors_up_to(total: int, limit: int, n: int) -> list[int]:
    """The `n` largest divisors of `total` that are at most `limit`."""
    found = []
    for parts in range(max(1, -(-total // limit)), total + 1):
        if total % parts == 0:
            found.append(total // parts)
            if len(found) == n:
                break
    return found


def _unshared(per_step: int, unit: int, world_size: int, names: tuple[str, str]) -> str:
    """Why `world_size` ranks cannot share tokens_per_step's units (of the setting and the
    word `names`: TrainConfig.unit_names), and what can."""
    units, (name, what) = per_step // unit, names
    hint = ""
    if per_step % world_size == 0:
        (t,) = _divisors_up_to(per_step // world_size, unit, 1)
        each = per_step // (t * world_size)
        hint = f"; or, on {world_size} ranks, train.{name}={t} ({each} a step on each rank)"
    smaller = (
        "" if name == "unit_tokens" else "; smaller train.unit_tokens let more ranks share a step"
    )
    return (
        f"train.tokens_per_step ({per_step}) is {units} {what} of train.{name} ({unit}), "
        f"fewer than the {world_size} ranks: run on at most {units} ranks{hint}. Another "
        f"{name} is another batch plan: a new run, not a resume of this one{smaller} "
        "(docs/distributed.md#the-global-batch)"
    )
