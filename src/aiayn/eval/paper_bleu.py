"""The paper's BLEU: tokenized, compound-split, case-sensitive.

The paper's WMT 2014 English->German figures (Table 2: 27.3 base, 28.4 big on newstest2014)
are not sacreBLEU's. They were computed as tensor2tensor's get_ende_bleu.sh computes them, and
fairseq's scripts/compound_split_bleu.sh after it: hypotheses and references tokenized by
Moses' tokenizer.perl (German rules), every hyphen between two non-blanks made a token of its
own, `##AT##-##AT##` (GNMT's convention, "for historical reasons": `rich-text` becomes
`rich ##AT##-##AT## text`), then multi-bleu.perl, BLEU of those tokens, case-sensitive, with
no smoothing. The split turns one compound into three tokens, of which the hyphen and often a
part match where the whole would not, so this figure reads higher than sacreBLEU's BLEU of the
same detokenized output, about a point on newstest2014 (why scores made in different ways do
not compare: Post, 2018, "A Call for Clarity in Reporting BLEU Scores"). Report sacreBLEU's,
with its signature; compare with the paper on this one.

Here both sides go through the same steps. get_ende_bleu.sh also ran Moses'
replace-unicode-punctuation.perl over the hypotheses (not over its references, which it had
tokenized beforehand); that step is left out.
"""

from __future__ import annotations

import re
from typing import Any

import sacrebleu

# Perl's `s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g` on bytes: only ASCII blanks are \s there, so
# every non-ASCII character counts as a non-blank (re.ASCII), and the matches do not overlap:
# in `a-b-c` the `b` is used by the first match, so the second hyphen stays (as in Perl).
COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)
AT = "##AT##-##AT##"

METRIC = "bleu_compound_split"


def split_compounds(line: str) -> str:
    """`rich-text format` -> `rich ##AT##-##AT## text format` (the perl one-liner above)."""
    return COMPOUND.sub(rf"\1 {AT} \2", line)


def moses_tokenize(lines: list[str], lang: str) -> list[str]:
    """Each line as tokenizer.perl -l LANG writes it (its defaults: no aggressive hyphen
    splitting, XML special characters escaped), through sacremoses."""
    from sacremoses import MosesTokenizer  # only this score needs it

    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, return_str=True, escape=True) for line in lines]


def compound_split_bleu(hyps: list[str], refs: list[str], lang: str = "de") -> dict[str, Any]:
    """The paper's BLEU of detokenized hypotheses against detokenized references (one each),
    with a signature that says how it was made."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses against {len(refs)} references")
    sides = [[split_compounds(t) for t in moses_tokenize(side, lang)] for side in (hyps, refs)]
    # On tokens already made: split on blanks (tok:none), no smoothing, as multi-bleu.perl
    # (which gives 0 where an n-gram order has no match, and so does smooth_method="none").
    bleu = sacrebleu.metrics.BLEU(tokenize="none", smooth_method="none", force=True)
    score = bleu.corpus_score(sides[0], [sides[1]])
    return {
        METRIC: score.score,
        f"{METRIC}_signature": f"moses-{lang}+{AT}|{bleu.get_signature()}",
    }
