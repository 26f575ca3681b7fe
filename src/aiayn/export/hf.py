"""Export to Hugging Face transformers: MarianMTModel for translation, OPTForCausalLM for the lm.

The directory holds what `from_pretrained` reads (config.json, model.safetensors,
generation_config.json, the tokenizer files), written without importing transformers: it must
never enter the training environment (DeepSpeed and accelerate change behaviour when it can be
imported). tests/unit/test_export_hf.py loads the files in the benchmarks' venv and checks that
the log-probabilities and greedy outputs equal the project's.

Marian is the paper's post-LN Transformer with one difference: its sinusoid is [sin | cos] where
the project's (and the paper's) interleaves them. Permuting the d_model axis of every weight,
LayerNorm and embedding maps one onto the other exactly: attention and the FFN only take dot
products over that axis, and LayerNorm's mean and variance do not depend on the order. The
project's table is written too, but transformers treats Marian's as a constant (recomputed when
absent, left out by save_pretrained), so the weights must fit Marian's own. A learned table
loads the same way (an exact export) but is then lost to save_pretrained: the export warns.
Marian has no pre-LN form (no final LayerNorm), so a pre-LN translation model is refused.

OPT covers every lm variant: its position table is learned (any table loads, two rows later
than the position, OPT's offset), do_layer_norm_before picks pre- or post-LN, and the pre-LN
final LayerNorm is there. It does not scale the token embeddings by sqrt(d_model), so the scale
is folded into its input embedding, which then can no longer be the output projection: the
output matrix is written untied.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from aiayn.errors import ExportError
from aiayn.export.bart_layout import (
    layer_pairs,
    marian_permutation,
    permute_residual,
    to_theirs,
)
from aiayn.export.reader import ExportSource, load_source, sinusoid_table
from aiayn.runtime.durable import atomic_directory

log = logging.getLogger(__name__)

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}

# OPTLearnedPositionalEmbedding looks position p up at row p + 2 (fairseq's padding offset).
_OPT_POSITION_OFFSET = 2


def export_hf(checkpoint: str | Path, output: str | Path, dtype: str = "fp32") -> Path:
    """Write `checkpoint` as a transformers model directory at `output`; returns it."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    src = load_source(checkpoint)
    model = src.cfg.model
    if model.kind == "seq2seq":
        _check_marian(src)
        config, weights = _marian_config(src), _marian_weights(src)
        tokenizer_files = _marian_tokenizer(src)
    else:
        config, weights, tokenizer_files = _opt(src)
    torch_dtype, dtype_name = DTYPES[dtype]
    weights = {k: v.to(torch_dtype, copy=True).contiguous() for k, v in weights.items()}
    config["dtype"] = dtype_name
    with atomic_directory(Path(output)) as tmp:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        generation = _generation_config(config, model.max_len, src.cfg.decode.min_len)
        _write_json(tmp / "generation_config.json", generation)
        for name, data in tokenizer_files.items():
            path = tmp / name
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                _write_json(path, data)
    if model.kind == "seq2seq" and model.positions == "learned":
        log.warning(
            "%s has learned positions: MarianMTModel.from_pretrained loads them exactly, but "
            "its save_pretrained() leaves position tables out (to Marian they are fixed "
            "sinusoids). Before saving it again from transformers, set "
            "model._keys_to_ignore_on_save = None",
            output,
        )
    return Path(output)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _generation_config(config: dict, max_len: int, min_len: int) -> dict:
    # Greedy as `aiayn translate --beam 1` / `aiayn generate --temperature 0` decode: no eos
    # forced at the length limit (Marian's default forces one), and at most the position
    # table's length in all (a translation's start token included).
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    out = {k: config[k] for k in keys if k in config}
    if "decoder_start_token_id" in config:  # translation: as aiayn.infer.decode, never pad or bos,
        banned = {config["pad_token_id"], config["decoder_start_token_id"]}
        out["bad_words_ids"] = [[i] for i in sorted(banned)]
        if min_len:  # and eos not before decode.min_len tokens
            out["min_new_tokens"] = min_len
    return {
        **out,
        "forced_eos_token_id": None,
        "max_length": max_len,
        "num_beams": 1,
        "do_sample": False,
    }


def _specials(src: ExportSource) -> dict[str, str]:
    """The pieces of the fixed special ids, as this tokenizer spells them."""
    tok = src.tokenizer
    return {
        "pad_token": tok.id_to_piece(tok.pad_id),
        "unk_token": tok.id_to_piece(tok.unk_id),
        "bos_token": tok.id_to_piece(tok.bos_id),
        "eos_token": tok.id_to_piece(tok.eos_id),
    }


def _position_table(src: ExportSource, embeddings: str) -> torch.Tensor:
    """(max_len, d_model) position encodings of `embeddings` (src_embed, tgt_embed, embed)."""
    m = src.cfg.model
    if m.positions == "learned":
        return src.weights[f"{embeddings}.positions.weight"]
    return sinusoid_table(m.d_model, m.max_len, m.positions)


# --- translation: MarianMTModel ------------------------------------------------------------


def _check_marian(src: ExportSource) -> None:
    if src.cfg.model.norm == "pre":
        raise ExportError(
            f"{src.checkpoint} is a pre-LN translation model (model.norm=pre): MarianMTModel, "
            "the transformers class for translation, has post-LN layers only, so it cannot "
            "compute this model exactly. Export it with --format ctranslate2 instead"
        )


def _marian_weights(src: ExportSource) -> dict[str, torch.Tensor]:
    m, w = src.cfg.model, src.weights
    out = to_theirs(w, layer_pairs("encoder", "model.encoder", m.N, cross=False))
    out.update(to_theirs(w, layer_pairs("decoder", "model.decoder", _dec(m), cross=True)))
    for ours, theirs in (("src_embed", "model.encoder"), ("tgt_embed", "model.decoder")):
        out[f"{theirs}.embed_positions.weight"] = _position_table(src, ours)
    rows = _marian_rows(src.tokenizer)  # a Marian vocabulary's own ids, or aiayn's
    if m.share_embeddings == "all":
        out["model.shared.weight"] = w["src_embed.token.weight"][rows]
    else:
        out["model.encoder.embed_tokens.weight"] = w["src_embed.token.weight"][rows]
        out["model.decoder.embed_tokens.weight"] = w["tgt_embed.token.weight"][rows]
        # Written even when tied to the decoder's embedding: transformers 5.0 unties it there
        # (tie_word_embeddings reads False) and would leave lm_head at its random init.
        out["lm_head.weight"] = w["out.weight"][rows]
    bias = w.get("out.bias")  # model.output_bias: Marian's final_logits_bias
    out["final_logits_bias"] = torch.zeros(1, len(rows)) if bias is None else bias[rows][None, :]
    # Marian's sinusoids are the sines then the cosines: a model whose are interleaved has its
    # residual stream's dimensions permuted into that order, which changes no output.
    if m.positions == "sinusoidal_concat":
        return out
    perm = marian_permutation(m.d_model)
    return {name: permute_residual(name, t, perm) for name, t in out.items()}


def _dec(m) -> int:
    return m.decoder_layers or m.N


def _marian_rows(tok) -> torch.Tensor:
    """The aiayn row of each Marian id: an imported vocabulary's own order (its pad row from
    aiayn's bos, the decoder start that training moves; see aiayn.tokenizer.marian), else
    aiayn's."""
    if tok.bundle is None:
        return torch.arange(tok.vocab_size)
    rows = torch.empty(len(tok.bundle.vocab), dtype=torch.long)
    rows[torch.tensor(tok.bundle.order)] = torch.arange(tok.vocab_size)
    rows[tok.bundle.specials["decoder_start"]] = tok.bos_id
    return rows


def _marian_config(src: ExportSource) -> dict:
    m, tok = src.cfg.model, src.tokenizer
    share = m.share_embeddings
    # The data path starts every target with bos (evaluate.translate, decode.greedy_search);
    # an imported vocabulary keeps Marian's own ids, where that start is its pad.
    ids = {"pad": tok.pad_id, "eos": tok.eos_id, "decoder_start": tok.bos_id}
    if tok.bundle is not None:
        ids = {k: tok.bundle.specials[k] for k in ids}
    V = len(_marian_rows(tok))
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": V,
        "decoder_vocab_size": V,
        "d_model": m.d_model,
        "encoder_layers": m.N,
        "decoder_layers": _dec(m),
        "encoder_attention_heads": m.h,
        "decoder_attention_heads": m.h,
        "encoder_ffn_dim": m.d_ff,
        "decoder_ffn_dim": m.d_ff,
        "activation_function": m.activation,
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "activation_dropout": 0.0,
        "max_position_embeddings": m.max_len,
        "scale_embedding": True,
        "normalize_before": False,
        "share_encoder_decoder_embeddings": share == "all",
        "tie_word_embeddings": share != "none",
        "is_encoder_decoder": True,
        "pad_token_id": ids["pad"],
        "eos_token_id": ids["eos"],
        "bos_token_id": ids["decoder_start"],
        "decoder_start_token_id": ids["decoder_start"],
        "forced_eos_token_id": None,
        # What Marian's layout cannot say, for `aiayn import-hf` to restore the model exactly;
        # transformers keeps unknown keys and ignores them.
        "aiayn": {"positions": m.positions},
    }


def _marian_tokenizer(src: ExportSource) -> dict:
    tok = src.tokenizer
    if tok.bundle is not None:  # an imported Marian model: its files as they came
        b = tok.bundle
        return {
            "source.spm": b.source_spm,
            "target.spm": b.target_spm,
            "vocab.json": b.vocab_json,
            "tokenizer_config.json": b.tokenizer_config,
        }
    model = tok.path.read_bytes()
    vocab = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}
    specials = _specials(src)
    del specials["bos_token"]  # MarianTokenizer has none; the model starts from bos itself
    # MarianTokenizer encodes with source.spm, maps pieces to ids through vocab.json (here
    # SentencePiece's own order) and appends eos, as evaluate.translate does.
    return {
        "source.spm": model,
        "target.spm": model,
        "vocab.json": vocab,
        "tokenizer_config.json": {
            "tokenizer_class": "MarianTokenizer",
            **specials,
            "model_max_length": src.cfg.model.max_len,  # the eos it appends included
            "separate_vocabs": False,
        },
    }


# --- language model: OPTForCausalLM -----------------------------------------------------


def _opt(src: ExportSource) -> tuple[dict, dict[str, torch.Tensor], dict]:
    m, w, tok = src.cfg.model, src.weights, src.tokenizer
    if m.output_bias:
        raise ExportError(
            f"{src.checkpoint} has an output bias (model.output_bias): OPTForCausalLM, the "
            "transformers class for language models, has none. Export it with --format "
            "ctranslate2 instead"
        )
    D = m.d_model
    out = to_theirs(w, layer_pairs("decoder", "model.decoder", _dec(m), cross=False))
    if m.norm == "pre":
        out["model.decoder.final_layer_norm.weight"] = w["decoder.norm.weight"]
        out["model.decoder.final_layer_norm.bias"] = w["decoder.norm.bias"]
    out["model.decoder.embed_positions.weight"] = torch.cat(
        [torch.zeros(_OPT_POSITION_OFFSET, D), _position_table(src, "embed")]
    )
    out["model.decoder.embed_tokens.weight"] = w["embed.token.weight"] * math.sqrt(D)
    out["lm_head.weight"] = w["out.weight"]
    config = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "vocab_size": tok.vocab_size,
        "hidden_size": D,
        "word_embed_proj_dim": D,
        "num_hidden_layers": m.decoder_layers or m.N,
        "num_attention_heads": m.h,
        "ffn_dim": m.d_ff,
        "max_position_embeddings": m.max_len,
        "do_layer_norm_before": m.norm == "pre",
        "_remove_final_layer_norm": False,
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "activation_function": m.activation,
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "layerdrop": 0.0,
        "tie_word_embeddings": False,
        "pad_token_id": tok.pad_id,
        # Every text starts after an eos in training (eval.lm_scores.text_stream,
        # infer.generate.sample_text): eos is also the start token a prompt-less generate()
        # begins from.
        "bos_token_id": tok.eos_id,
        "eos_token_id": tok.eos_id,
    }
    return config, out, _lm_tokenizer(src)


def _lm_tokenizer(src: ExportSource) -> dict:
    specials = _specials(src)
    specials["bos_token"] = specials["eos_token"]  # the start token (see _opt)
    return {
        "tokenizer.model": src.tokenizer.path.read_bytes(),
        "tokenizer_config.json": {
            "tokenizer_class": "SentencePieceBackend",
            **specials,
            "special_tokens_pattern": "bos",
            "model_max_length": src.cfg.model.max_len,
        },
    }
