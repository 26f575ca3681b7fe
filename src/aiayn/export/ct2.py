"""Export to CTranslate2 (OpenNMT's C++ inference engine): `aiayn export CHECKPOINT --format
ctranslate2 --output DIR [--quantization int8|int16|float16|...]`.

DIR holds what CTranslate2 reads, and what aiayn needs to run it the way the trainer decodes:

    model.bin, config.json      the weights (in the quantization asked for) and CTranslate2's
                                config: the special tokens, layer-norm epsilon
    *vocabulary.json            the SentencePiece pieces in the project's id order, so that
                                CTranslate2's token ids are the project's ids
    spm.model                   the SentencePiece model itself
    aiayn.json                  what the export came from and how to decode with it
                                (METADATA_FILE; read by aiayn.export.ct2_runtime)

The model maps onto CTranslate2's TransformerSpec (encoder-decoder) or
TransformerDecoderModelSpec (decoder only) one to one: the fused qkv projection is CTranslate2's
fused self-attention linear (same q, k, v order), the cross-attention's q and fused kv are its
linear[0] and linear[1], each sublayer's LayerNorm is that sublayer's layer_norm (applied before
or after the residual as model.norm says), the final LayerNorm of a pre-LN stack is the stack's
layer_norm, and a tied matrix is written under each of its names (CTranslate2 stores equal
tensors once). What the export must spell out, because CTranslate2's defaults differ:

- Positions. CTranslate2's built-in sinusoid is another table (the [sin | cos] halves, another
  frequency step, positions counted from 1), so the project's own table is written. Its length
  caps decoding ("No position encodings are defined for positions >= N"): a sinusoidal export
  gets max(SINUSOID_ROWS, model.max_len) rows; learned positions stop at model.max_len, the
  length the model was trained to, which aiayn.json records as max_positions.
- LayerNorm epsilon: torch's 1e-5, where CTranslate2 assumes 1e-6.
- Special tokens, as the data path has them: a translation source is its tokens + eos
  (config.json's add_source_eos), the target starts with bos (decoder_start_token); a
  language model's text starts after an eos (the document separator; aiayn.json's
  lm_start_token), which a caller puts at the head of every prompt.
- Length penalty. CTranslate2's beam search divides a hypothesis' log-probability by
  len^length_penalty; the project's by GNMT's ((5 + len) / 6)^alpha (decode.length_penalty).
  Greedy search and scoring are the same in both; beam search can rank two hypotheses of
  different lengths differently.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch

from aiayn.errors import ExportError
from aiayn.export.reader import ExportSource, load_source, sinusoid_table
from aiayn.runtime.durable import atomic_directory

log = logging.getLogger("aiayn")

METADATA_FILE = "aiayn.json"
"""Beside CTranslate2's files: the source checkpoint, model kind, tokenizer contract, position
limit and the run's config (its decode settings among them)."""
TOKENIZER_FILE = "spm.model"
FORMAT = "aiayn-ctranslate2"
FORMAT_VERSION = 1

SINUSOID_ROWS = 1024
"""The fewest rows of a sinusoidal export's position table: the longest source, and the longest
target, it can decode (CTranslate2's own max_input_length default is the same 1024)."""
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which every norm of the model uses


def require_ctranslate2():
    """The ctranslate2 module, or an ExportError saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise ExportError(
            "ctranslate2 is not installed: pip install ctranslate2 (or, in the clone, "
            "pip install -e '.[serve]')"
        ) from None
    return ctranslate2


def export_ctranslate2(
    checkpoint: str | Path, output: str | Path, quantization: str | None = None
) -> Path:
    """Write `checkpoint` (a run_dir, a step or averaged dir, or an exported .safetensors) as a
    CTranslate2 model directory `output`, weights stored as `quantization` (None: float32).

    A sinusoidal model decodes up to max(1024, model.max_len) positions in CTranslate2; a model
    with learned positions up to model.max_len (a warning says so, and aiayn.json records it).
    Beam search in CTranslate2 normalises by len^alpha, not GNMT's ((5 + len) / 6)^alpha.
    """
    output = Path(output)
    if output.exists():
        raise ExportError(f"{output} exists: choose another --output, or delete it first")
    require_ctranslate2()
    source = load_source(checkpoint)
    converter = _converter(source)
    with atomic_directory(output) as tmp:
        # The temporary directory exists already: force lets CTranslate2 write into it.
        converter.convert(str(tmp), quantization=quantization, force=True)
        shutil.copyfile(source.tokenizer.path, tmp / TOKENIZER_FILE)
        metadata = _metadata(source, quantization)
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")
    if source.cfg.model.positions == "learned":
        log.warning(
            "%s: learned positions end at model.max_len = %d, so CTranslate2 decodes at most "
            "%d positions (source + eos, or target); a longer input is cut to fit",
            output,
            source.cfg.model.max_len,
            source.cfg.model.max_len,
        )
    return output


def max_positions(source: ExportSource) -> int:
    """Rows of the exported position table: the most positions CTranslate2 can decode."""
    model = source.cfg.model
    return model.max_len if model.positions == "learned" else max(SINUSOID_ROWS, model.max_len)


def _converter(source: ExportSource):
    from ctranslate2.converters import Converter

    class AiaynConverter(Converter):
        def _load(self):
            return build_spec(source)

    return AiaynConverter()


def build_spec(source: ExportSource):
    """The CTranslate2 model spec of `source`, every weight set; ExportError if a weight the
    model needs is missing or one is left over (a model this exporter does not know)."""
    from ctranslate2.specs import Activation, TransformerDecoderModelSpec, TransformerSpec

    cfg, tok = source.cfg.model, source.tokenizer
    weights = _Weights(source)
    pre_norm = cfg.norm == "pre"
    decoder_layers = cfg.decoder_layers or cfg.N
    rows = max_positions(source)
    activation = {"relu": Activation.RELU, "swish": Activation.SWISH}[cfg.activation]
    if cfg.kind == "seq2seq":
        spec = TransformerSpec.from_config(
            (cfg.N, decoder_layers), cfg.h, pre_norm=pre_norm, activation=activation
        )
        _fill_stack(spec.encoder, weights, "encoder", "src_embed", cfg, rows, cross=None)
        _fill_stack(spec.decoder, weights, "decoder", "tgt_embed", cfg, rows, cross=True)
        spec.config.add_source_eos = True  # the data path's source is its tokens + eos
        spec.config.decoder_start_token = tok.id_to_piece(tok.bos_id)
    else:
        # num_heads_kv spelled out: left None, CTranslate2 4.x flags the model multi-query.
        spec = TransformerDecoderModelSpec.from_config(
            decoder_layers, cfg.h, pre_norm=pre_norm, num_heads_kv=cfg.h, activation=activation
        )
        _fill_stack(spec.decoder, weights, "decoder", "embed", cfg, rows, cross=False)
    weights.check_all_used()
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.config.unk_token = tok.id_to_piece(tok.unk_id)
    spec.config.bos_token = tok.id_to_piece(tok.bos_id)
    spec.config.eos_token = tok.id_to_piece(tok.eos_id)
    vocabulary = vocabulary_of(tok)
    if cfg.kind == "seq2seq":
        spec.register_source_vocabulary(vocabulary)
        spec.register_target_vocabulary(vocabulary)
    else:
        spec.register_vocabulary(vocabulary)
    return spec


def vocabulary_of(tok) -> list[str]:
    """Every piece in id order: CTranslate2's token i is the project's id i."""
    return [tok.id_to_piece(i) for i in range(tok.vocab_size)]


class _Weights:
    """The source's weights, each handed out once, so that a missing name and an unused one are
    both caught."""

    def __init__(self, source: ExportSource):
        self.left = dict(source.weights)
        self.where = source.checkpoint

    def take(self, name: str) -> torch.Tensor:
        try:
            return self.left.pop(name)
        except KeyError:
            raise ExportError(
                f"{self.where} has no weight {name!r}: it is not a model this exporter knows; "
                "export it with --format safetensors, or from a checkpoint of this aiayn version"
            ) from None

    def check_all_used(self) -> None:
        if self.left:
            raise ExportError(
                f"{self.where} has weights the CTranslate2 export has no place for: "
                f"{', '.join(sorted(self.left)[:5])}; export it with --format safetensors, or "
                "teach aiayn/export/ct2.py where they go"
            )


def _fill_stack(spec, weights: _Weights, stack: str, embed: str, cfg, rows: int, cross) -> None:
    """An encoder (cross None) or decoder stack: its embeddings, positions, layers and, pre-LN,
    its final LayerNorm; a decoder also its output projection."""
    table = (
        weights.take(f"{embed}.positions.weight")
        if cfg.positions == "learned"
        else sinusoid_table(cfg.d_model, rows, cfg.positions)
    )
    spec.position_encodings.encodings = table
    token = weights.take(f"{embed}.token.weight")
    if isinstance(spec.embeddings, list):  # the encoder's: one per source feature
        spec.embeddings[0].weight = token
    else:
        spec.embeddings.weight = token
    for i, layer in enumerate(spec.layer):
        prefix = f"{stack}.layers.{i}"
        bias = cfg.attention_bias
        if cross is None:
            _attention(layer.self_attention, weights, prefix, "self_attn", "res_attn", bias)
        else:
            _attention(layer.self_attention, weights, prefix, "self_attn", "res_self", bias)
            if cross:
                _attention(layer.attention, weights, prefix, "cross_attn", "res_cross", bias)
        _linear(layer.ffn.linear_0, weights, f"{prefix}.ffn.w_1", bias=True)
        _linear(layer.ffn.linear_1, weights, f"{prefix}.ffn.w_2", bias=True)
        _norm(layer.ffn.layer_norm, weights, f"{prefix}.res_ffn.norm")
    if cfg.norm == "pre":
        _norm(spec.layer_norm, weights, f"{stack}.norm")
    if cross is not None:
        _linear(spec.projection, weights, "out", bias=cfg.output_bias)


def _attention(spec, weights: _Weights, prefix: str, name: str, residual: str, bias: bool) -> None:
    """Self-attention: linear [qkv, out]; cross-attention: linear [q, kv, out] (CTranslate2 has
    the same fusions, in the same order). Biases only with model.attention_bias (§3.2.2 has
    none)."""
    fused = ["qkv"] if name == "self_attn" else ["q", "kv"]
    for linear, part in zip(spec.linear, [*fused, "out"], strict=True):
        _linear(linear, weights, f"{prefix}.{name}.{part}", bias=bias)
    _norm(spec.layer_norm, weights, f"{prefix}.{residual}.norm")


def _linear(spec, weights: _Weights, name: str, bias: bool = False) -> None:
    spec.weight = weights.take(f"{name}.weight")
    if bias:
        spec.bias = weights.take(f"{name}.bias")


def _norm(spec, weights: _Weights, name: str) -> None:
    spec.gamma = weights.take(f"{name}.weight")
    spec.beta = weights.take(f"{name}.bias")


def _metadata(source: ExportSource, quantization: str | None) -> dict:
    cfg, tok = source.cfg, source.tokenizer
    piece = tok.id_to_piece
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "kind": cfg.model.kind,
        "source_checkpoint": str(source.checkpoint),
        "step": _step(source.checkpoint),
        "quantization": quantization or "float32",
        "positions": cfg.model.positions,
        "max_positions": max_positions(source),
        "max_positions_note": (
            "CTranslate2 decodes at most max_positions positions: a source of at most "
            "max_positions - 1 tokens (+ eos), a target or lm text of at most max_positions"
        ),
        "tokenizer_file": TOKENIZER_FILE,
        "tokenizer": tok.contract(),
        "special_tokens": {
            "source_suffix": piece(tok.eos_id),
            "target_start": piece(tok.bos_id),
            "lm_start_token": piece(tok.eos_id),
            "note": (
                "seq2seq: CTranslate2 appends eos to the source and starts the target with bos "
                "(config.json); lm: every prompt starts with eos, as every document does in "
                "training, and a running text (data.lm_order stream) has eos at each line break"
            ),
        },
        "decode": dataclasses.asdict(cfg.decode),
        "length_penalty_note": (
            "aiayn ranks beam hypotheses by log P / ((5 + len) / 6)^alpha (GNMT); CTranslate2 "
            "by log P / len^length_penalty. Greedy search and scores are the same."
        ),
        "config": cfg.to_dict(),
    }


def _step(checkpoint: Path) -> int | None:
    """The training step of the checkpoint exported (a step or averaged dir's manifest, or an
    exported .safetensors' metadata)."""
    from aiayn.checkpoint import read_manifest

    if checkpoint.is_file():
        from safetensors import safe_open

        with safe_open(checkpoint, framework="pt") as fh:
            step = (fh.metadata() or {}).get("aiayn_step")
        return int(step) if step is not None else None
    return read_manifest(checkpoint, verify=False).get("step")
