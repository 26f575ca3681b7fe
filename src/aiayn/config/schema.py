"""The run configuration: every section and key, its type, default, documented meaning and
accepted range, and the checks across keys. The one module to read to learn what a config file
may say; reading files and overrides into it is loading.py's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from aiayn import metric_names
from aiayn.config.checks import Section, bounded, range_errors, suggest

# Table 3 of the paper, plus small presets that train on a laptop CPU in minutes.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "transformer_base": dict(N=6, d_model=512, d_ff=2048, h=8, dropout=0.1),
    "transformer_big": dict(N=6, d_model=1024, d_ff=4096, h=16, dropout=0.3),
    "small": dict(N=3, d_model=256, d_ff=1024, h=4, dropout=0.1),
    "tiny": dict(N=2, d_model=128, d_ff=512, h=4, dropout=0.1),
}


@dataclass
class ModelConfig(Section):
    kind: Literal["seq2seq", "lm", "classifier"] = "seq2seq"
    """seq2seq: encoder-decoder (translation); lm: decoder only; classifier: encoder + head."""
    preset: str | None = None
    """Name from MODEL_PRESETS; its values apply unless a key is set explicitly."""
    N: int = bounded(6, low=1)
    """Layers in the encoder, and in the decoder unless decoder_layers is set (§3.1)."""
    decoder_layers: int | None = bounded(None, low=1)
    """Decoder layers when they differ from N."""
    d_model: int = bounded(512, low=1)
    """Width of every sublayer's input and output, and of the embeddings (§3.1)."""
    d_ff: int = bounded(2048, low=1)
    """Inner width of the position-wise feed-forward network (§3.3)."""
    h: int = bounded(8, low=1)
    """Attention heads; d_k = d_v = d_model / h (§3.2.2)."""
    dropout: float = bounded(0.1, low=0, high=1, high_open=True)
    """Residual and embedding dropout, P_drop (§5.4)."""
    attention_dropout: float = bounded(0.0, low=0, high=1, high_open=True)
    """Dropout on attention weights (not in the paper; tensor2tensor uses it)."""
    positions: Literal["sinusoidal", "sinusoidal_concat", "learned"] = "sinusoidal"
    """Sinusoidal encodings (§3.5: sin and cos interleaved), sinusoidal_concat (the same
    sines in the first half of the dimensions, the cosines in the second: tensor2tensor's,
    fairseq's and Marian's layout), or learned position embeddings."""
    norm: Literal["post", "pre"] = "post"
    """post: LayerNorm(x + Sublayer(x)) as in the paper; pre: x + Sublayer(LayerNorm(x))."""
    max_len: int = bounded(1024, low=1)
    """Longest sequence (in tokens) the position table covers."""
    activation: Literal["relu", "swish"] = "relu"
    """The feed-forward network's activation: relu (§3.3), or swish, x * sigmoid(x) (SiLU;
    Marian's OPUS-MT models)."""
    attention_bias: bool = False
    """Biases on the attention projections W^Q, W^K, W^V and W^O (§3.2.2 has none; Marian's
    models do)."""
    output_bias: bool = False
    """A bias on the pre-softmax output projection (Marian's final_logits_bias)."""
    share_embeddings: Literal["all", "decoder", "none"] = "all"
    """all: source, target and output share one matrix (needs the joint vocabulary, §3.4);
    decoder: target embedding and output projection; none: three separate matrices.
    An lm has no source side, so all means decoder there."""
    num_classes: int = bounded(2, low=1)
    """Output classes (classifier only)."""
    pooling: Literal["mean", "first"] = "mean"
    """How the classifier pools encoder states: mean over non-pad tokens, or the first token."""

    def validate(self) -> list[str]:
        errs = []
        if self.h >= 1 and self.d_model % self.h:
            errs.append(f"model.d_model ({self.d_model}) must be divisible by model.h ({self.h})")
        if self.preset is not None and self.preset not in MODEL_PRESETS:
            errs.append(
                f"model.preset {self.preset!r} is not a preset; choose from "
                f"{sorted(MODEL_PRESETS)}" + suggest(self.preset, MODEL_PRESETS)
            )
        return errs


@dataclass
class TokenizerConfig(Section):
    path: str | None = None
    """SentencePiece model file; default <run_dir>/tokenizer/spm.model. Trained if missing."""
    type: Literal["bpe", "unigram", "char"] = "bpe"
    """SentencePiece model type; char: one piece per character (vocab_size is then an upper
    bound: the vocabulary is the corpus's characters plus the four specials)."""
    vocab_size: int = bounded(8000, low=8)
    """Size of the one joint source+target vocabulary (§3.4 shares it between languages)."""
    normalization: Literal["nmt_nfkc", "nfkc", "identity"] = "nmt_nfkc"
    """SentencePiece's normalization rule. identity, with remove_extra_whitespaces false, makes
    decode(encode(text)) == text, so that a score per character is a score of the exact text."""
    remove_extra_whitespaces: bool = True
    """Drop leading and trailing spaces and collapse runs of spaces before encoding."""
    character_coverage: float = bounded(1.0, low=0, low_open=True, high=1)
    """Share of characters covered by the vocabulary (0.9995 for scripts with many characters)."""
    sample_sentences: int = bounded(1_000_000, low=1)
    """At most this many sentences, read from the training stream, train the tokenizer."""
    user_symbols: list[str] = field(default_factory=list)
    """Extra symbols that are never split (e.g. language tags)."""
    seed: int = 1
    """Seed of the sentence sample; the same seed gives the same tokenizer."""


# A source's name becomes part of a directory and of TensorBoard tags (valid_<name>/bleu).
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass
class SourceConfig(Section):
    """One corpus of a mixture (data.sources). The rest of the data section (format,
    languages, fields, max_len) applies to every source."""

    name: str = ""
    """Required. What logs, TensorBoard (data/<name>/..., valid_<name>/...) and the token cache
    (<cache_dir>/train-<name>) call it: letters, digits, _ and -."""
    path: str = ""
    """Required. What data.train takes: a file prefix (parallel), a path or glob, or a hub split
    name (of data.hub_name)."""
    weight: float | None = bounded(None, low=0, low_open=True)
    """Its share of the epoch's examples is weight / sum of the weights (rounded by largest
    remainder). Give every source a weight, or data.temperature instead."""
    tag: str | None = None
    """A token put before each of its training examples' source sentence (e.g. <BT> for
    back-translated data). It must be one piece of the tokenizer: a tokenizer trained by the
    run adds every tag to its user_defined_symbols. Counts towards max_len and the token
    budget; validation, test and inference inputs are never tagged."""
    valid: str | None = None
    """Its own dev set (same form as path), scored at each validation as valid_<name>/...;
    data.valid stays the one checkpoint.best_metric ranks by."""

    def validate(self) -> list[str]:
        errs = []
        if not SOURCE_NAME.fullmatch(self.name):
            errs.append(
                f"name {self.name!r} must be letters, digits, _ and - (it names a directory and "
                "TensorBoard tags)"
            )
        if not self.path:
            errs.append("path is required (what data.train takes)")
        if self.tag is not None and (not self.tag or any(c.isspace() for c in self.tag)):
            errs.append(f"tag {self.tag!r} must be one token: no spaces, not empty")
        return errs


@dataclass
class DataConfig(Section):
    format: Literal["parallel", "tsv", "jsonl", "parquet", "text", "hub"] = "parallel"
    """parallel: PREFIX.SRC + PREFIX.TGT line-aligned files (gzip allowed); tsv/jsonl/parquet:
    one file (or glob) per split; text: one document per line (lm); hub: a hub dataset name."""
    train: str | None = None
    """Training split: a file prefix (parallel), a path or glob, or a hub split name."""
    valid: str | None = None
    """Validation split, same form as train."""
    test: str | None = None
    """Test split, same form as train."""
    src_lang: str = "de"
    """Source language: the file suffix (parallel) and the default source field."""
    tgt_lang: str = "en"
    """Target language: the file suffix (parallel) and the default target field."""
    src_field: str | None = None
    """Field holding the source text (dots reach into nested records: translation.de)."""
    tgt_field: str | None = None
    """Field holding the target text."""
    text_field: str = "text"
    """Field holding the text (lm, classifier)."""
    label_field: str = "label"
    """Field holding the integer class (classifier)."""
    hub_name: str | None = None
    """Hub dataset name for format hub, e.g. bentrevett/multi30k or wmt/wmt14."""
    hub_config: str | None = None
    """Hub dataset configuration, e.g. de-en."""
    hub_revision: str | None = None
    """Hub dataset revision (a commit, tag or branch) for format hub. Unset, the first start
    records the commit the Hub serves (run_dir/data/hub_revision.json) and every later start
    reads that one, so a restart reads the same records after the dataset changed."""
    max_len: int = bounded(256, low=2)
    """Examples with more tokens than this on either side are dropped and counted."""
    shuffle_buffer: int = bounded(10_000, low=0)
    """Examples bucketed by length together (streamed: also read and shuffled together); 0
    keeps the stream order."""
    on_invalid_utf8: Literal["skip", "error"] = "skip"
    """A line that is not valid UTF-8 is skipped and counted, or stops the run."""
    cache: bool = True
    """true: the training split is tokenised once (`aiayn data prepare`, or at the start of
    `aiayn train` if missing) into memory-mapped arrays; every rank plans the epoch's batches
    from their lengths and reads only its own, and the epoch is shuffled whole, bucketed in
    windows of shuffle_buffer. false: stream and tokenise while training (nothing written to
    disk; every rank reads and tokenises the whole stream)."""
    lm_order: Literal["documents", "stream"] = "documents"
    """How an lm reads its training split (token cache only). documents: one document per line,
    empty lines dropped, documents shuffled each epoch. stream: the lines in corpus order form
    one running text (eos marks each line break, empty lines included), cut into blocks at a
    random offset each epoch, blocks shuffled: for books and articles, whose lines continue
    each other."""
    unit: Literal["tokens", "characters", "words"] = "tokens"
    """What an lm's evaluation counts besides tokens, so that models with different tokenizers
    compare: characters gives bits per character, words word-level perplexity (whitespace-
    separated words, plus one per line for its end)."""
    cache_dir: str | None = None
    """Where token caches live, one folder per split; default <run_dir>/data_cache. Point runs
    on the same data and tokenizer at one directory to tokenise once for all of them.
    Environment variables are expanded on each node ($SLURM_TMPDIR/aiayn_cache)."""
    cache_scope: Literal["shared", "node"] = "shared"
    """shared: cache_dir is storage every node sees; the ranks build the cache together and rank
    0 alone verifies it. node: cache_dir is each node's own disk; each node builds (its ranks
    sharing the reading) or opens its own copy, its first rank verifies it, and every node's
    copy must hold the same tokens as rank 0's."""
    pad_to_multiple: int | None = bounded(None, low=1)
    """A batch's source and target widths are rounded up to a multiple of this (never past
    max_len + 1), and the token budget counts the rounding. Fewer distinct shapes mean fewer
    torch.compile graphs, and tensor cores want multiples of 8. None (auto): 8 on CUDA, 1 (no
    rounding) on CPU; the run's config.yaml records the value used. lm blocks are max_len wide
    whatever it is."""

    sources: list[SourceConfig] = field(default_factory=list)
    """Train on a mixture of corpora instead of data.train: a list of {name, path, weight or
    (with temperature) none, tag, valid} (SourceConfig), for model.kind seq2seq or classifier.
    Each source has its own token cache (or, with data.cache false, its own stream: then
    data.epoch is not tokens); every epoch takes a fixed count of each source's
    examples, a function of (train.seed, the sources, their weights, the epoch) alone, so the
    batches are the same at any world size and a resume is exact (docs/data.md#mixtures)."""
    temperature: float | None = bounded(None, low=0, low_open=True)
    """Instead of weights: source s's share is N_s^(1/T) / sum, N_s its examples (T = 1: by
    size; larger T: flatter, up-sampling small sources)."""
    epoch: Literal["sum", "largest", "source", "examples", "tokens"] = "sum"
    """What one epoch of a mixture is. sum: as many examples as all sources hold; largest: one
    pass over the largest source; source: one pass over data.epoch_source; examples: epoch_size
    examples; tokens: about epoch_size target tokens (epoch_size / the mixture's mean target
    tokens per example, eos included). The start-up log says how many examples that is."""
    epoch_source: str | None = None
    """The source whose one pass is an epoch (data.epoch source)."""
    epoch_size: int | None = bounded(None, low=1)
    """Examples (data.epoch examples) or target tokens (data.epoch tokens) of an epoch."""

    def validate(self) -> list[str]:
        errs = self._validate_sources() if self.sources else self._validate_no_sources()
        if self.train is None and not self.sources:
            errs.append(
                "data.train is required (a file prefix, path, or hub split name), or "
                "data.sources for a mixture"
            )
        if self.format == "hub" and not self.hub_name:
            errs.append("data.hub_name is required when data.format is hub")
        if self.cache_scope == "node" and not self.cache_dir:
            errs.append(
                "data.cache_scope=node keeps a copy of the token cache on each node's own disk: "
                "set data.cache_dir to a directory there (e.g. $SLURM_TMPDIR/aiayn_cache)"
            )
        if self.lm_order == "stream" and not self.cache:
            errs.append(
                "data.lm_order=stream plans the whole text's blocks and needs the token cache: "
                "set data.cache=true (or data.lm_order=documents)"
            )
        return errs

    def _validate_no_sources(self) -> list[str]:
        used = [
            f"data.{k}"
            for k, default in (("temperature", None), ("epoch", "sum"), ("epoch_source", None))
            if getattr(self, k) != default
        ] + (["data.epoch_size"] if self.epoch_size is not None else [])
        if used:
            return [f"{', '.join(used)} describe a mixture: set data.sources (or remove them)"]
        return []

    def _validate_sources(self) -> list[str]:
        errs = []
        for i, source in enumerate(self.sources):
            where = f"data.sources[{i}]"
            errs += range_errors(source, where)
            errs += [f"{where}.{e}" for e in source.validate()]
        names = [s.name for s in self.sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            errs.append(f"data.sources: each name once; {', '.join(twice)} given twice")
        if self.train is not None:
            errs.append(
                "data.train and data.sources are both set: one source is data.train, a mixture "
                "is data.sources (move data.train into it as a source)"
            )
        weighted = [s.name for s in self.sources if s.weight is not None]
        if self.temperature is not None and weighted:
            errs.append(
                f"data.temperature sets every source's share: remove the weights of "
                f"{', '.join(weighted)} (or data.temperature)"
            )
        if self.temperature is None and len(weighted) != len(self.sources):
            missing = [s.name for s in self.sources if s.weight is None]
            errs.append(
                f"data.sources {', '.join(missing)} have no weight: give every source a "
                "weight, or set data.temperature"
            )
        errs += self._validate_epoch(names)
        if not self.cache and self.epoch == "tokens":
            errs.append(
                "data.epoch=tokens needs the sources' mean lengths, which a stream does not "
                "have before it is tokenised whole: with data.cache=false, give the epoch in "
                "examples (data.epoch=examples) or by the sources' sizes (sum, largest, "
                "source), or set data.cache=true"
            )
        return errs

    def _validate_epoch(self, names: list[str]) -> list[str]:
        errs = []
        if self.epoch == "source" and self.epoch_source not in names:
            errs.append(
                f"data.epoch=source counts one pass over data.epoch_source, which must name a "
                f"source ({', '.join(names)}); got {self.epoch_source!r}"
            )
        if self.epoch != "source" and self.epoch_source is not None:
            errs.append("data.epoch_source is for data.epoch=source")
        sized = self.epoch in ("examples", "tokens")
        if sized and self.epoch_size is None:
            errs.append(f"data.epoch={self.epoch} needs data.epoch_size ({self.epoch} per epoch)")
        if not sized and self.epoch_size is not None:
            errs.append("data.epoch_size is for data.epoch=examples or tokens")
        return errs


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
    """Tokens per micro-batch (padding included), like fairseq --max-tokens."""
    grad_accum: int = bounded(1, low=1)
    """Micro-batches per optimizer step; the schedule steps once per optimizer step."""
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
    fp32's throughput (torch_runtime.py). No effect on CPU."""
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
    memory_probe: Literal["auto", "always", "never"] = "auto"
    """Before the first step (of a new or resumed run), one forward and backward pass of the
    epoch's largest batch, gradients then dropped and no random state moved, so that an
    out-of-memory error comes in the first minute rather than hours in; it logs the peak
    memory. auto: on CUDA only (always: on CPU too). Training is the same with it or without."""


@dataclass
class DistributedConfig(Section):
    backend: Literal["ddp", "deepspeed"] = "ddp"
    """ddp: PyTorch DistributedDataParallel (also the single-process path); deepspeed: ZeRO."""
    zero_stage: int = bounded(0, low=0, high=3)
    """DeepSpeed ZeRO stage: 0 none, 1 optimizer states, 2 also gradients, 3 also parameters
    are partitioned across data-parallel ranks."""
    offload_optimizer: bool = False
    """ZeRO-Offload (stage >= 1): optimizer state and step on the CPU (DeepSpeedCPUAdam)."""
    offload_params: bool = False
    """ZeRO-3 parameter offload to the CPU."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of storing them."""
    deepspeed_config: str | None = None
    """A JSON file of extra DeepSpeed keys (e.g. configs/deepspeed/*.json) merged into the
    config generated from this one; a key that contradicts the generated value is an error."""
    setup_timeout_minutes: float = bounded(120.0, low=0, low_open=True)
    """How long a collective may wait until set-up is done (tokenizer training on rank 0,
    building the token cache, building the model, restoring a checkpoint). Longer than
    training's: rank 0 trains the tokenizer of a WMT-size corpus while the others wait."""
    timeout_minutes: float = bounded(10.0, low=0, low_open=True)
    """How long a collective may wait once set-up is done: after a rank died or hung, the
    others stop with an error this long after, instead of holding their GPUs."""

    def validate(self) -> list[str]:
        errs = []
        if self.backend == "ddp":
            used = [
                f"distributed.{name}"
                for name in (
                    "zero_stage",
                    "offload_optimizer",
                    "offload_params",
                    "deepspeed_config",
                )
                if getattr(self, name)
            ]
            if used:
                errs.append(f"{', '.join(used)} need distributed.backend=deepspeed")
        elif self.offload_optimizer and self.zero_stage < 1:
            errs.append("distributed.offload_optimizer needs distributed.zero_stage >= 1")
        if self.offload_params and self.zero_stage != 3:
            errs.append("distributed.offload_params needs distributed.zero_stage=3")
        return errs


@dataclass
class InitConfig(Section):
    source: str | None = None
    """Start this run from a trained model's weights (fine-tuning, or continuing with new
    settings): a run directory (its latest valid checkpoint; RUN/best, RUN/latest and
    RUN/averaged name those), a checkpoint step directory, an averaged model (aiayn average,
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


@dataclass
class DecodeConfig(Section):
    beam: int = bounded(4, low=1)
    """Beam size; 1 is greedy search (§6.1 uses 4)."""
    alpha: float = 0.6
    """Length penalty ((5 + len) / 6)^alpha (§6.1)."""
    max_len_b: int = bounded(50, low=1)
    """Hypotheses stop at source length + max_len_b tokens (§6.1)."""
    min_len: int = bounded(1, low=0)
    """Tokens a hypothesis has at least before eos (fairseq's min_len; 0: none). With 0, beam
    search under the length penalty takes the empty hypothesis (eos first) wherever the model
    is unsure of a long sentence: 3.9% of a Multi30k en->de model's outputs (docs/recipes.md).
    An empty source line is translated as an empty line either way."""
    batch_size: int = bounded(64, low=1)
    """Sentences decoded together."""
    bleu_tokenize: str = "13a"
    """sacreBLEU tokenizer: 13a (WMT standard), intl, char (for one-word targets), none."""

    def validate(self) -> list[str]:
        errs = []
        if self.bleu_tokenize not in ("13a", "intl", "char", "none", "zh", "ja-mecab", "flores200"):
            errs.append(f"decode.bleu_tokenize {self.bleu_tokenize!r} is not a sacreBLEU tokenizer")
        return errs


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
        if self.train.compile and self.distributed.backend == "deepspeed":
            errs.append(
                "train.compile is for distributed.backend ddp (and one process): DeepSpeed's "
                "hooks gather and reduce inside the layers torch.compile would trace; set "
                "train.compile=false or distributed.backend=ddp"
            )
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
