"""Import a Hugging Face MarianMT (OPUS-MT) directory as an aiayn model: `aiayn import-hf`.

It reads config.json, model.safetensors or pytorch_model.bin (tensors only: no code runs),
vocab.json, tokenizer_config.json, source.spm and target.spm, and writes what `aiayn export`
writes (FILE.safetensors with its .config.yaml and .tokenizer.model), which `init.source`,
`aiayn translate`, `aiayn evaluate` and the exports read. The model is exact: MarianMTModel is
the paper's post-LN Transformer with the options aiayn's model has as keys (model.activation
swish, attention_bias, output_bias for final_logits_bias, positions sinusoidal_concat for
Marian's [sin | cos] table). What it cannot compute exactly is refused, one line per key.

The names, the sinusoid permutation (export/bart_layout.py) and the vocabulary's ids
(aiayn.tokenizer.marian) are the ones the HF export writes with, read the other way. A directory
that `aiayn export --format hf` wrote (config.json's "aiayn" entry) comes back bitwise: its
layout is restored and its tokenizer is its own SentencePiece model again.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from aiayn.checkpoint.average import export_module
from aiayn.config import load_config
from aiayn.errors import ExportError, TokenizerError
from aiayn.export.bart_layout import (
    is_attention_bias,
    layer_pairs,
    marian_permutation,
    permute_residual,
    to_ours,
)
from aiayn.model import build_model
from aiayn.model.positions import SinusoidalPositions
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from aiayn.tokenizer.marian import Bundle, write_bundle

log = logging.getLogger(__name__)

FILES = ("config.json", "vocab.json", "source.spm", "target.spm", "tokenizer_config.json")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish"}


def import_hf(source: str | Path, output: str | Path, revision: str | None = None) -> Path:
    """Write the MarianMT model at `source` (a local directory, or a hub name such as
    Helsinki-NLP/opus-mt-de-en) as the aiayn export `output` (FILE.safetensors)."""
    directory, origin = model_directory(source, revision)
    config = _json(directory / "config.json")
    tok_config = _json(directory / "tokenizer_config.json", required=False)
    refuse_inexact(config, tok_config, directory)
    theirs = _read_weights(directory)
    tokenizer, order = _tokenizer(directory, config, tok_config)
    model_keys, weights = _model(config, theirs, order)
    cfg = load_config(
        None,
        [f"model.{k}={'null' if v is None else v}" for k, v in model_keys.items()]
        + [
            "data.train=imported-from-hf",  # a fine-tune's own config names its data
            f"data.max_len={model_keys['max_len'] - 2}",  # room for bos/eos
            f"data.src_lang={tok_config.get('source_lang') or 'src'}",
            f"data.tgt_lang={tok_config.get('target_lang') or 'tgt'}",
        ],
    )
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".import-") as tmp:
        tok_path = Path(tmp) / "tokenizer.model"
        tok_path.write_bytes(tokenizer)
        tok = Tokenizer(tok_path)
        model = build_model(cfg.model, tok.vocab_size, tok.pad_id)
        model.load_state_dict(weights, strict=True)
        raw = cfg.to_dict()
        raw["tokenizer"]["vocab_size"] = tok.vocab_size
        return export_module(model, raw, tok, output, source=origin)


def is_hf_model(source: str | Path) -> bool:
    """Whether `source` names a transformers model: a directory with config.json and no aiayn
    checkpoint in it, or, where no such path exists, a hub name (owner/name)."""
    path = Path(source)
    if path.is_dir():
        return (path / "config.json").is_file() and not (path / "manifest.json").is_file()
    text = str(source)
    return not path.exists() and text.count("/") == 1 and not text.startswith((".", "/", "~"))


def model_directory(source: str | Path, revision: str | None) -> tuple[Path, str]:
    """(a local directory holding the model's files, where it came from): `source` itself, or
    the hub's files of that name downloaded at `revision` (the commit recorded)."""
    path = Path(source)
    if path.is_dir():
        if revision:
            raise ExportError(
                f"--revision {revision}: {source} is a local directory, not a hub name"
            )
        return path, f"hf:{path.resolve()}"
    if path.exists() or str(source).count("/") != 1:
        raise ExportError(
            f"{source} is not a model directory (one with config.json, vocab.json, source.spm "
            "and target.spm) nor a hub name such as Helsinki-NLP/opus-mt-de-en"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        local = Path(
            snapshot_download(
                str(source), revision=revision, allow_patterns=[*FILES, *WEIGHTS, "*.json"]
            )
        )
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ExportError(
            f"could not download {source} from the Hugging Face hub ({exc}); check the name "
            "and the network, or download the directory and pass its path"
        ) from None
    return local, f"hf:{source}@{local.name}"  # snapshots/<commit>


def _json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if not required:
            return {}
        raise ExportError(f"{path} is missing: a MarianMT directory holds {', '.join(FILES)}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ExportError(f"{path} is not valid JSON ({exc})") from None


def refuse_inexact(config: dict, tok_config: dict, where: Path) -> None:
    """Raise one error listing every setting aiayn's model cannot compute exactly, each
    naming its key."""
    problems = []
    if config.get("model_type") != "marian":
        problems.append(
            f"model_type is {config.get('model_type')!r}: only MarianMT (marian) imports"
        )
    if tok_config.get("separate_vocabs") or config.get("decoder_vocab_size") not in (
        None,
        config.get("vocab_size"),
    ):
        problems.append(
            "separate_vocabs / decoder_vocab_size: separate source and target vocabularies; "
            "aiayn's model has one vocabulary for both sides"
        )
    if config.get("normalize_before") or config.get("add_final_layer_norm"):
        problems.append("normalize_before: a pre-norm Marian variant; aiayn imports post-norm")
    if config.get("normalize_embedding") or config.get("layernorm_embedding"):
        problems.append("normalize_embedding: a LayerNorm on the embeddings, which aiayn has not")
    if not config.get("scale_embedding", False):
        problems.append("scale_embedding is false: aiayn scales embeddings by sqrt(d_model)")
    for key in ("ffn_dim", "attention_heads"):
        enc, dec = config.get(f"encoder_{key}"), config.get(f"decoder_{key}")
        if enc != dec:
            problems.append(
                f"encoder_{key} {enc} != decoder_{key} {dec}: aiayn's encoder and decoder "
                "have one width"
            )
    act = config.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        problems.append(
            f"activation_function {act!r}: aiayn has {', '.join(sorted(set(ACTIVATIONS)))}"
        )
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ExportError(f"{where} cannot be imported exactly:\n{lines}")


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHTS:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".safetensors"):
            return load_file(path)
        # weights_only: tensors and containers, never code (a pickle could run any)
        state = torch.load(path, map_location="cpu", weights_only=True)
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    raise ExportError(f"{directory} has no {' or '.join(WEIGHTS)}")


def _specials(config: dict, tok_config: dict, vocab: dict, where: Path) -> dict[str, int]:
    """Marian's ids of pad, unk, eos and the decoder start."""
    unk = tok_config.get("unk_token", "<unk>")
    unk = unk.get("content") if isinstance(unk, dict) else unk
    if unk not in vocab:
        raise ExportError(f"{where}/vocab.json has no unknown-word piece {unk!r} (unk_token)")
    pad, eos = config.get("pad_token_id"), config.get("eos_token_id")
    if pad is None or eos is None:
        raise ExportError(f"{where}/config.json lacks pad_token_id or eos_token_id")
    start = config.get("decoder_start_token_id")
    return {
        "pad": pad,
        "unk": vocab[unk],
        "eos": eos,
        "decoder_start": pad if start is None else start,
    }


def _tokenizer(directory: Path, config: dict, tok_config: dict) -> tuple[bytes, list[int]]:
    """(the tokenizer file's bytes, the Marian id of each aiayn id)."""
    models = [directory / name for name in ("source.spm", "target.spm")]
    if not all(m.is_file() for m in models):
        raise ExportError(f"{directory} lacks source.spm or target.spm (MarianTokenizer's models)")
    source, target = (m.read_bytes() for m in models)
    vocab_json = (directory / "vocab.json").read_bytes()
    vocab = json.loads(vocab_json)
    specials = _specials(config, tok_config, vocab, directory)
    if _is_own_model(source, target, vocab, specials):
        return source, list(range(len(vocab)))
    bundle = Bundle(source, target, vocab, vocab_json, specials, tok_config)
    return write_bundle(bundle), bundle.order


def _is_own_model(source: bytes, target: bytes, vocab: dict, specials: dict) -> bool:
    """Whether the directory holds an aiayn SentencePiece model as `aiayn export --format hf`
    writes it: one model on both sides, vocab.json its own ids, aiayn's specials."""
    aiayn = {"pad": PAD_ID, "unk": UNK_ID, "eos": EOS_ID, "decoder_start": BOS_ID}
    if source != target or specials != aiayn:
        return False
    with tempfile.NamedTemporaryFile(suffix=".model") as fh:
        fh.write(source)
        fh.flush()
        try:
            tok = Tokenizer(fh.name)
        except TokenizerError:  # other special ids: the bundle maps them
            return False
        return tok.vocab_size == len(vocab) and all(
            vocab.get(tok.id_to_piece(i)) == i for i in range(tok.vocab_size)
        )


def _model(config: dict, w: dict[str, torch.Tensor], order: list[int]) -> tuple[dict, dict]:
    """(aiayn's model keys, aiayn's state_dict) of the Marian config and tensors `w`."""
    w = {
        k if k.startswith(("model.", "lm_head", "final_logits")) else f"model.{k}": v
        for k, v in w.items()
    }
    N, dec = config["encoder_layers"], config["decoder_layers"]
    pairs = layer_pairs("encoder", "model.encoder", N, cross=False)
    pairs += layer_pairs("decoder", "model.decoder", dec, cross=True)
    missing = [p.theirs for p in pairs if p.theirs not in w]
    if missing:
        raise ExportError(
            f"the weights lack {len(missing)} tensors of the config's layers, e.g. {missing[0]}"
        )
    layout = config.get("aiayn", {}).get("positions")  # written by aiayn's export
    positions = layout or _positions(config, w)
    if layout in ("sinusoidal", "learned"):  # the export permuted these into Marian's layout
        inverse = torch.argsort(marian_permutation(config["d_model"]))
        w = {name: permute_residual(name, t, inverse) for name, t in w.items()}
    attention_bias = any(bool(w[p.theirs].any()) for p in pairs if is_attention_bias(p))
    ours = to_ours(w, pairs, attention_bias)
    ours.update(_vocabulary_rows(config, w, torch.tensor(order)))
    if positions == "learned":
        ours["src_embed.positions.weight"] = w["model.encoder.embed_positions.weight"]
        ours["tgt_embed.positions.weight"] = w["model.decoder.embed_positions.weight"]
    if config.get("activation_dropout"):
        log.warning(
            "activation_dropout %g is not an aiayn setting: fine-tuning runs without it",
            config["activation_dropout"],
        )
    keys = {
        "kind": "seq2seq",
        "N": N,
        "decoder_layers": None if dec == N else dec,  # as aiayn writes an even stack
        "d_model": config["d_model"],
        "d_ff": config["encoder_ffn_dim"],
        "h": config["encoder_attention_heads"],
        "dropout": config.get("dropout", 0.1),
        "attention_dropout": config.get("attention_dropout", 0.0),
        "positions": positions,
        "norm": "post",
        "max_len": config["max_position_embeddings"],
        "activation": ACTIVATIONS[config.get("activation_function", "swish")],
        "attention_bias": attention_bias,
        "output_bias": "out.bias" in ours,
        "share_embeddings": _share(config),
    }
    return keys, ours


def _vocabulary_rows(config: dict, w: dict, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The embeddings, output projection and output bias in aiayn's ids (`rows`: the Marian
    row of each). Every name of a tied matrix is in aiayn's state_dict; load_state_dict fills
    them alike. A final_logits_bias of zeros (Marian always has one) is no output bias."""
    share = _share(config)
    shared = w.get("model.shared.weight", w.get("model.encoder.embed_tokens.weight"))
    src = shared if share == "all" else w.get("model.encoder.embed_tokens.weight", shared)
    tgt = shared if share == "all" else w.get("model.decoder.embed_tokens.weight", shared)
    out = w["lm_head.weight"] if share == "none" else tgt
    ours = {"src_embed.token.weight": src[rows], "tgt_embed.token.weight": tgt[rows]}
    ours["out.weight"] = out[rows]
    bias = w.get("final_logits_bias")
    if bias is not None and bool(bias.any()):
        ours["out.bias"] = bias[0][rows]
    return ours


def _share(config: dict) -> str:
    if not config.get("tie_word_embeddings", True):
        return "none"
    return "all" if config.get("share_encoder_decoder_embeddings", True) else "decoder"


def _positions(config: dict, w: dict[str, torch.Tensor]) -> str:
    """Marian's fixed [sin | cos] table (sinusoidal_concat), unless the file holds another
    table, which MarianMTModel loads and uses (learned)."""
    d, rows = config["d_model"], config["max_position_embeddings"]
    table = SinusoidalPositions(d, rows, concat=True).pe
    for side in ("encoder", "decoder"):
        found = w.get(f"model.{side}.embed_positions.weight")
        if found is not None and not torch.allclose(found.float(), table, atol=1e-5):
            return "learned"
    return "sinusoidal_concat"
