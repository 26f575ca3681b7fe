"""Marian's vocabulary in aiayn's ids: two SentencePiece models and one joint vocab.json, kept
together in one file (a "bundle") that a run uses as its tokenizer.

A MarianMT (OPUS-MT) model segments the source with source.spm and the target with target.spm,
and maps the pieces of both through one vocab.json (piece -> id) whose specials sit elsewhere
than aiayn's fixed pad 0, unk 1, bos 2, eos 3 (OPUS: </s> 0, <unk> 1, <pad> last). The
bundle's ids are Marian's, permuted so that the specials land on aiayn's: aiayn id i is Marian
id `order[i]` (`aiayn_order`), and the embedding rows of an imported model are permuted the
same way, so a sentence's aiayn ids are MarianTokenizer's under that map.

Marian starts decoding from its pad token. aiayn's pad is masked as an attention key, so its
decoder start (bos) is a second row, a copy of Marian's pad row under a piece name of its own:
the vocabulary grows by one, and decoding bans pad and bos (decode.py) as Marian's
generate bans pad. The exporter writes the pad row back from the bos row, the one training
moves (pad is never a key or a target).

The bundle is a zip archive, stored, with fixed timestamps so the same inputs give the same
bytes (its sha256 is the tokenizer contract's): source.spm, target.spm and vocab.json as the
model directory had them, and marian.json with the Marian ids of the specials and the
directory's tokenizer_config.json.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass

from aiayn.errors import TokenizerError

MAGIC = b"PK\x03\x04"
_FILES = ("source.spm", "target.spm", "vocab.json", "marian.json")
_STAMP = (1980, 1, 1, 0, 0, 0)
WORD_MARK = "\u2581"  # SentencePiece's word boundary, "▁"
# The piece name of aiayn's decoder start where Marian's is its pad (one of these not in vocab).
_BOS_PIECES = ("<s>", "<aiayn_bos>")


@dataclass(frozen=True)
class Bundle:
    source_spm: bytes
    target_spm: bytes
    vocab: dict[str, int]  # Marian's piece -> id, as vocab.json has it
    vocab_json: bytes  # vocab.json's own bytes, written back unchanged by an export
    specials: dict[str, int]  # Marian ids of pad, unk, eos and decoder_start
    tokenizer_config: dict  # the directory's tokenizer_config.json

    @property
    def order(self) -> list[int]:
        return aiayn_order(self.vocab, self.specials)

    def pieces(self) -> list[str]:
        """The piece of each aiayn id."""
        by_id = {i: p for p, i in self.vocab.items()}
        pieces = [by_id[m] for m in self.order]
        if self.specials["decoder_start"] == self.specials["pad"]:
            pieces[2] = next(p for p in _BOS_PIECES if p not in self.vocab)
        return pieces


def aiayn_order(vocab: dict[str, int], specials: dict[str, int]) -> list[int]:
    """The Marian id of each aiayn id: pad, unk, decoder start and eos at aiayn's 0-3, then
    every other Marian id in its own order. Where Marian starts decoding from its pad, both
    aiayn's pad and bos are its pad row (len = V + 1)."""
    V = len(vocab)
    if sorted(vocab.values()) != list(range(V)):
        raise TokenizerError(
            "vocab.json's ids are not 0 .. N-1, each once: it is not a MarianTokenizer "
            "vocabulary this importer can map"
        )
    pad, unk, eos, start = (specials[k] for k in ("pad", "unk", "eos", "decoder_start"))
    if len({pad, unk, eos}) < 3 or start in (unk, eos):
        raise TokenizerError(
            f"pad {pad}, unk {unk}, eos {eos} and decoder start {start} must be different ids "
            "(the decoder start may be pad): check config.json's pad_token_id, eos_token_id, "
            "decoder_start_token_id and tokenizer_config.json's unk_token"
        )
    head = [pad, unk, start, eos]
    taken = set(head)
    return head + [m for m in range(V) if m not in taken]


def write_bundle(bundle: Bundle) -> bytes:
    """The bundle's bytes: the same inputs give the same bytes."""
    marian = {"specials": bundle.specials, "tokenizer_config": bundle.tokenizer_config}
    members = {
        "source.spm": bundle.source_spm,
        "target.spm": bundle.target_spm,
        "vocab.json": bundle.vocab_json,
        "marian.json": (json.dumps(marian, indent=2, sort_keys=True) + "\n").encode(),
    }
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for name in _FILES:
            info = zipfile.ZipInfo(name, date_time=_STAMP)
            info.external_attr = 0o644 << 16
            zf.writestr(info, members[name])
    return out.getvalue()


def read_bundle(data: bytes, where: str) -> Bundle:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            members = {name: zf.read(name) for name in _FILES}
        marian = json.loads(members["marian.json"])
        vocab = json.loads(members["vocab.json"])
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise TokenizerError(
            f"{where} is not a Marian vocabulary bundle ({exc}); import the model again with "
            "`aiayn import-hf DIR --output FILE.safetensors`"
        ) from None
    return Bundle(
        source_spm=members["source.spm"],
        target_spm=members["target.spm"],
        vocab=vocab,
        vocab_json=members["vocab.json"],
        specials=marian["specials"],
        tokenizer_config=marian["tokenizer_config"],
    )


def language_code(text: str) -> tuple[list[str], str]:
    """A leading >>xx<< target-language code, split off before segmenting as MarianTokenizer
    does (multilingual OPUS models): ([code] or [], the rest)."""
    if text.startswith(">>") and (end := text.find("<<")) != -1:
        return [text[: end + 2]], text[end + 2 :]
    return [], text


def decode_pieces(target_spm, pieces: list[str]) -> str:
    """A hypothesis's text as transformers' MarianTokenizer.decode(skip_special_tokens=True)
    gives it (the caller leaves out the special pieces, unknowns included): the pieces joined
    by target.spm, then every word mark left made a space. A piece only source.spm knows,
    which the joint vocabulary lets the decoder emit, comes back from target.spm as it is,
    its mark included."""
    return target_spm.decode_pieces(pieces).replace(WORD_MARK, " ").strip()
