"""Export to Hugging Face transformers: MarianMTModel for translation, OPTForCausalLM for the lm.

The directory holds what `from_pretrained` reads (config.json, model.safetensors,
generation_config.json, the tokenizer files), written without importing transformers: it must
never enter the training environment (DeepSpeed and accelerate change behaviour when it can be
imported). tests/unit/test_export_hf.py loads the files in the benchmarks' venv and checks that
the log-probabilities and greedy outputs equal the project's.

Marian is the paper's post-LN Transformer with one difference: its sinusoid is [sin | cos] where
the project's (and the paper's) interleaves them. Permuting the d_model axis of every weight,
LayerNorm and embedding maps one onto the other exactly: attention and the FFN only take dot
products over that axis, and LayerNorm's mean and variance do not depend on the order. Marian
has no pre-LN form (no final LayerNorm), so a pre-LN translation model is refused.

OPT covers every lm variant: its position table is learned (any table loads, two rows later
than the position, OPT's offset), do_layer_norm_before picks pre- or post-LN, and the pre-LN
final LayerNorm is there. It does not scale the token embeddings by sqrt(d_model), so the scale
is folded into its input embedding, which then can no longer be the output projection: the
output matrix is written untied.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from aiayn.errors import ExportError
from aiayn.export.source import ExportSource, load_source, sinusoid_table
from aiayn.files import atomic_directory

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
        _write_json(tmp / "generation_config.json", _generation_config(config, model.max_len))
        for name, data in tokenizer_files.items():
            path = tmp / name
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                _write_json(path, data)
    return Path(output)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _generation_config(config: dict, max_len: int) -> dict:
    # Greedy as `aiayn translate --beam 1` / `aiayn generate --temperature 0` decode: no eos
    # forced at the length limit (Marian's default forces one), and at most the position
    # table's length in all (a translation's start token included).
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return {
        **{k: config[k] for k in keys if k in config},
        "forced_eos_token_id": None,
        "max_length": max_len,
        "num_beams": 1,
        "do_sample": False,
    }


def _specials(src: ExportSource) -> dict[str, str]:
    """The pieces of the fixed special ids, as this tokenizer spells them."""
    sp = src.tokenizer.sp
    tok = src.tokenizer
    return {
        "pad_token": sp.id_to_piece(tok.pad_id),
        "unk_token": sp.id_to_piece(tok.unk_id),
        "bos_token": sp.id_to_piece(tok.bos_id),
        "eos_token": sp.id_to_piece(tok.eos_id),
    }


# --- translation: MarianMTModel ------------------------------------------------------------


def _check_marian(src: ExportSource) -> None:
    if src.cfg.model.norm == "pre":
        raise ExportError(
            f"{src.checkpoint} is a pre-LN translation model (model.norm=pre): MarianMTModel, "
            "the transformers class for translation, has post-LN layers only, so it cannot "
            "compute this model exactly. Export it with --format ctranslate2 instead"
        )


def _marian_permutation(d_model: int) -> torch.Tensor:
    """perm with marian[..., k] = project[..., perm[k]]: the even (sin) dimensions, then the
    odd (cos) ones."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _marian_weights(src: ExportSource) -> dict[str, torch.Tensor]:
    m, w = src.cfg.model, src.weights
    D = m.d_model
    perm = _marian_permutation(D)

    def rows(t: torch.Tensor) -> torch.Tensor:  # a Linear that writes the residual stream
        return t[perm]

    def cols(t: torch.Tensor) -> torch.Tensor:  # a Linear that reads it, or an embedding
        return t[:, perm]

    out: dict[str, torch.Tensor] = {}

    def attention(prefix: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor):
        # Head dimensions keep their order: only the axis the residual stream flows on moves.
        for name, weight in (("q_proj", cols(q)), ("k_proj", cols(k)), ("v_proj", cols(v))):
            out[f"{prefix}.{name}.weight"] = weight
            out[f"{prefix}.{name}.bias"] = torch.zeros(D)
        out[f"{prefix}.out_proj.weight"] = rows(o)
        out[f"{prefix}.out_proj.bias"] = torch.zeros(D)

    def norm(prefix: str, source: str) -> None:
        out[f"{prefix}.weight"] = w[f"{source}.weight"][perm]
        out[f"{prefix}.bias"] = w[f"{source}.bias"][perm]

    def ffn(prefix: str, source: str) -> None:
        out[f"{prefix}.fc1.weight"] = cols(w[f"{source}.w_1.weight"])
        out[f"{prefix}.fc1.bias"] = w[f"{source}.w_1.bias"]
        out[f"{prefix}.fc2.weight"] = rows(w[f"{source}.w_2.weight"])
        out[f"{prefix}.fc2.bias"] = w[f"{source}.w_2.bias"][perm]

    for i in range(m.N):
        s, t = f"encoder.layers.{i}", f"model.encoder.layers.{i}"
        attention(
            f"{t}.self_attn",
            *w[f"{s}.self_attn.qkv.weight"].chunk(3),
            w[f"{s}.self_attn.out.weight"],
        )
        norm(f"{t}.self_attn_layer_norm", f"{s}.res_attn.norm")
        ffn(t, f"{s}.ffn")
        norm(f"{t}.final_layer_norm", f"{s}.res_ffn.norm")
    for i in range(m.decoder_layers or m.N):
        s, t = f"decoder.layers.{i}", f"model.decoder.layers.{i}"
        attention(
            f"{t}.self_attn",
            *w[f"{s}.self_attn.qkv.weight"].chunk(3),
            w[f"{s}.self_attn.out.weight"],
        )
        norm(f"{t}.self_attn_layer_norm", f"{s}.res_self.norm")
        attention(
            f"{t}.encoder_attn",
            w[f"{s}.cross_attn.q.weight"],
            *w[f"{s}.cross_attn.kv.weight"].chunk(2),
            w[f"{s}.cross_attn.out.weight"],
        )
        norm(f"{t}.encoder_attn_layer_norm", f"{s}.res_cross.norm")
        ffn(t, f"{s}.ffn")
        norm(f"{t}.final_layer_norm", f"{s}.res_ffn.norm")

    for side in ("src", "tgt"):
        hf_side = "encoder" if side == "src" else "decoder"
        table = (
            w[f"{side}_embed.positions.weight"]
            if m.positions == "learned"
            else sinusoid_table(D, m.max_len)
        )
        out[f"model.{hf_side}.embed_positions.weight"] = cols(table)
    share = m.share_embeddings
    if share == "all":
        out["model.shared.weight"] = cols(w["src_embed.token.weight"])
    else:
        out["model.encoder.embed_tokens.weight"] = cols(w["src_embed.token.weight"])
        out["model.decoder.embed_tokens.weight"] = cols(w["tgt_embed.token.weight"])
    if share == "none":
        out["lm_head.weight"] = cols(w["out.weight"])
    out["final_logits_bias"] = torch.zeros(1, src.tokenizer.vocab_size)
    return out


def _marian_config(src: ExportSource) -> dict:
    m, tok = src.cfg.model, src.tokenizer
    share, V = m.share_embeddings, tok.vocab_size
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": V,
        "decoder_vocab_size": V,
        "d_model": m.d_model,
        "encoder_layers": m.N,
        "decoder_layers": m.decoder_layers or m.N,
        "encoder_attention_heads": m.h,
        "decoder_attention_heads": m.h,
        "encoder_ffn_dim": m.d_ff,
        "decoder_ffn_dim": m.d_ff,
        "activation_function": "relu",
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "activation_dropout": 0.0,
        "max_position_embeddings": m.max_len,
        "scale_embedding": True,
        "normalize_before": False,
        "share_encoder_decoder_embeddings": share == "all",
        "tie_word_embeddings": share != "none",
        "is_encoder_decoder": True,
        "pad_token_id": tok.pad_id,
        "eos_token_id": tok.eos_id,
        "bos_token_id": tok.bos_id,
        # The data path starts every target with bos (evaluate.translate, decode.greedy_search).
        "decoder_start_token_id": tok.bos_id,
        "forced_eos_token_id": None,
    }


def _marian_tokenizer(src: ExportSource) -> dict:
    tok = src.tokenizer
    model = tok.path.read_bytes()
    vocab = {tok.sp.id_to_piece(i): i for i in range(tok.vocab_size)}
    specials = _specials(src)
    del specials["bos_token"]  # MarianTokenizer has none; the model starts from bos itself
    return {
        "source.spm": model,
        "target.spm": model,
        "vocab.json": vocab,
        "tokenizer_config.json": {
            "tokenizer_class": "MarianTokenizer",
            **specials,
            "model_max_length": src.cfg.model.max_len - 1,  # the eos it appends fits too
            "separate_vocabs": False,
        },
    }


# --- language model: OPTForCausalLM -----------------------------------------------------


def _opt(src: ExportSource) -> tuple[dict, dict[str, torch.Tensor], dict]:
    m, w, tok = src.cfg.model, src.weights, src.tokenizer
    D = m.d_model
    out: dict[str, torch.Tensor] = {}
    for i in range(m.decoder_layers or m.N):
        s, t = f"decoder.layers.{i}", f"model.decoder.layers.{i}"
        q, k, v = w[f"{s}.self_attn.qkv.weight"].chunk(3)
        for name, weight in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            out[f"{t}.self_attn.{name}.weight"] = weight
            out[f"{t}.self_attn.{name}.bias"] = torch.zeros(D)
        out[f"{t}.self_attn.out_proj.weight"] = w[f"{s}.self_attn.out.weight"]
        out[f"{t}.self_attn.out_proj.bias"] = torch.zeros(D)
        for hf, ours in (
            ("self_attn_layer_norm", "res_self.norm"),
            ("final_layer_norm", "res_ffn.norm"),
        ):
            out[f"{t}.{hf}.weight"] = w[f"{s}.{ours}.weight"]
            out[f"{t}.{hf}.bias"] = w[f"{s}.{ours}.bias"]
        for hf, ours in (("fc1", "w_1"), ("fc2", "w_2")):
            out[f"{t}.{hf}.weight"] = w[f"{s}.ffn.{ours}.weight"]
            out[f"{t}.{hf}.bias"] = w[f"{s}.ffn.{ours}.bias"]
    if m.norm == "pre":
        out["model.decoder.final_layer_norm.weight"] = w["decoder.norm.weight"]
        out["model.decoder.final_layer_norm.bias"] = w["decoder.norm.bias"]
    table = (
        w["embed.positions.weight"] if m.positions == "learned" else sinusoid_table(D, m.max_len)
    )
    out["model.decoder.embed_positions.weight"] = torch.cat(
        [torch.zeros(_OPT_POSITION_OFFSET, D), table]
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
        "activation_function": "relu",
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "layerdrop": 0.0,
        "tie_word_embeddings": False,
        "pad_token_id": tok.pad_id,
        # Every text starts after an eos in training (lm_eval.text_stream, lm_eval.sample):
        # eos is also the start token a prompt-less generate() begins from.
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
