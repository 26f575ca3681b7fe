"""Build MarianMT (OPUS-MT layout) directories with transformers, and what transformers
computes with them, for test_import_hf.py.

Runs in the benchmarks' venv (transformers never enters the training venv) and imports nothing
from aiayn, so the directories are what a user downloads, not what aiayn's export writes:

    python marian_build.py build SPEC.json RESULTS.json   tokenizers and random models
    python marian_build.py check SPEC.json RESULTS.json   only what transformers computes

SPEC.json: {"corpus": a dir with train.de and train.en, "root": output dir, "spm_vocab":
[source, target] (default [60, 70]), "variants": [{"name", "activation", "tie", "weights"
(safetensors or bin), "dims" ({"d_model", "layers", "heads", "ffn", "positions"}; default a
2-layer d_model 32), "randomize" (default true)}], "src_texts", "tgt_texts", "max_len_b"}
(check: {"dirs": [...], ...} with the same texts). RESULTS.json: {dir: {"src_ids",
"tgt_ids" (MarianTokenizer's, eos included), "pad", "eos", "start", "logits" (each row's
decoder logits for start + tgt_ids without eos, (len, V)), "greedy" (generate with pad banned,
after the start token, cut at eos), "decode_rows" (target ids holding pieces only the source
model knows) and "decoded" (MarianTokenizer's text of each)}}. Exit status 3 if transformers
is missing.
"""

import json
import sys
from pathlib import Path

try:
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer
except ImportError as exc:
    print(f"marian_build.py: {exc}", file=sys.stderr)
    sys.exit(3)


def train_spm(lines: list[str], prefix: Path, vocab_size: int) -> Path:
    # SentencePiece's default ids (unk 0, <s> 1, </s> 2), as OPUS-MT's models have them
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        minloglevel=2,
        num_threads=1,
        hard_vocab_limit=False,  # the demo corpus has few words
    )
    return prefix.with_suffix(".model")


def opus_vocab(models: list[Path]) -> dict[str, int]:
    """</s> 0, <unk> 1, the pieces of both models (source first), <pad> last: OPUS's layout
    (with one language code, >>en<<, as multilingual OPUS models have them)."""
    vocab = {"</s>": 0, "<unk>": 1, ">>en<<": 2}  # a target-language code, as multilingual
    for path in models:
        sp = spm.SentencePieceProcessor(model_file=str(path))
        for i in range(sp.vocab_size()):
            piece = sp.id_to_piece(i)
            if piece not in vocab and piece not in ("<s>", "</s>", "<unk>"):
                vocab[piece] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


def build(spec: dict) -> list[Path]:
    corpus, root = Path(spec["corpus"]), Path(spec["root"])
    root.mkdir(parents=True, exist_ok=True)
    sizes = spec.get("spm_vocab", [60, 70])
    src = train_spm((corpus / "train.de").read_text().splitlines(), root / "source", sizes[0])
    tgt = train_spm((corpus / "train.en").read_text().splitlines(), root / "target", sizes[1])
    vocab = opus_vocab([src, tgt])
    (root / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tok = MarianTokenizer(
        str(src), str(tgt), str(root / "vocab.json"), source_lang="de", target_lang="en"
    )
    dirs = []
    for i, v in enumerate(spec["variants"]):
        out = root / v["name"]
        dims = {"d_model": 32, "layers": 2, "heads": 4, "ffn": 64, "positions": 64}
        dims.update(v.get("dims", {}))
        config = MarianConfig(
            vocab_size=len(vocab),
            decoder_vocab_size=len(vocab),
            d_model=dims["d_model"],
            encoder_layers=dims["layers"],
            decoder_layers=dims["layers"],
            encoder_attention_heads=dims["heads"],
            decoder_attention_heads=dims["heads"],
            encoder_ffn_dim=dims["ffn"],
            decoder_ffn_dim=dims["ffn"],
            activation_function=v["activation"],
            max_position_embeddings=dims["positions"],
            pad_token_id=vocab["<pad>"],
            eos_token_id=0,
            decoder_start_token_id=vocab["<pad>"],
            forced_eos_token_id=None,
            scale_embedding=True,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=v["tie"],
            dropout=0.1,
        )
        torch.manual_seed(i)
        model = MarianMTModel(config)
        with torch.no_grad():  # every bias and LayerNorm off its init: zeros hide mapping bugs
            for name, p in model.named_parameters() if v.get("randomize", True) else ():
                if name.endswith("bias") or "norm" in name:
                    p.add_(0.2 * torch.randn_like(p))
                else:
                    p.mul_(8.0)  # past init_std 0.02, so the logits are not all alike
            if v.get("randomize", True):
                model.final_logits_bias.copy_(0.5 * torch.randn_like(model.final_logits_bias))
        model.generation_config.bad_words_ids = [[config.pad_token_id]]
        if v["weights"] == "bin":
            out.mkdir(parents=True, exist_ok=True)
            config.save_pretrained(out)
            state = {k: t.contiguous() for k, t in model.state_dict().items()}
            state = {k: t for k, t in state.items() if "embed_positions" not in k}
            torch.save(state, out / "pytorch_model.bin")
        else:
            model.save_pretrained(out)
        tok.save_pretrained(out)
        dirs.append(out)
    return dirs


def compute(directory: Path, spec: dict) -> dict:
    tok = MarianTokenizer.from_pretrained(str(directory))
    model = MarianMTModel.from_pretrained(str(directory)).eval()
    cfg = model.config
    src_ids = [tok(t)["input_ids"] for t in spec["src_texts"]]
    tgt_ids = [tok(text_target=t)["input_ids"] for t in spec["tgt_texts"]]
    logits, greedy = [], []
    with torch.no_grad():
        for s, t in zip(src_ids, tgt_ids, strict=True):
            dec = torch.tensor([[cfg.decoder_start_token_id, *t[:-1]]])
            out = model(input_ids=torch.tensor([s]), decoder_input_ids=dec).logits[0]
            logits.append(out.tolist())
        for s in src_ids:
            limit = min(len(s) + spec["max_len_b"], cfg.max_position_embeddings - 1)
            ids = model.generate(
                input_ids=torch.tensor([s]),
                num_beams=1,
                do_sample=False,
                max_new_tokens=limit,
                bad_words_ids=[[cfg.pad_token_id]],
                forced_eos_token_id=None,
            )[0].tolist()[1:]
            greedy.append(ids[: ids.index(cfg.eos_token_id)] if cfg.eos_token_id in ids else ids)
    return {
        "src_ids": src_ids,
        "tgt_ids": tgt_ids,
        **decoded(tok, tgt_ids),
        "pad": cfg.pad_token_id,
        "eos": cfg.eos_token_id,
        "start": cfg.decoder_start_token_id,
        "logits": logits,
        "greedy": greedy,
    }


def decoded(tok, tgt_ids: list[list[int]]) -> dict:
    """Rows of target ids with pieces that only the source model knows among the target's
    (the joint vocabulary lets a decoder emit them), and MarianTokenizer's text of each; none
    where the models have fewer than 3 such pieces."""
    vocab = tok.get_vocab()
    tgt, src = tok.spm_target, tok.spm_source
    source_only = [
        i
        for piece, i in sorted(vocab.items(), key=lambda item: item[1])
        if piece.startswith("\u2581")
        and len(piece) > 1
        and tgt.piece_to_id(piece) == tgt.unk_id()
        and src.piece_to_id(piece) != src.unk_id()
    ]
    if len(source_only) < 3:  # a spec whose models share their pieces (the e2e test's)
        return {"decode_rows": [], "decoded": []}
    rows = [
        [*tgt_ids[0][:1], *source_only[:2], *tgt_ids[0][1:-1]],
        [source_only[2], *tgt_ids[1][:-1]],
    ]
    return {"decode_rows": rows, "decoded": tok.batch_decode(rows, skip_special_tokens=True)}


def main() -> None:
    mode, spec_path, results_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    dirs = build(spec) if mode == "build" else [Path(d) for d in spec["dirs"]]
    results = {str(d): compute(d, spec) for d in dirs}
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
