"""The validation metrics, by name: computed by eval/scores.py and eval/lm_scores.py, logged to
TensorBoard as valid/<name>, recorded in a checkpoint's manifest under the same tag, and ranked
by checkpoint.best_metric (config/run.py). One definition, so the four cannot drift apart."""

LOSS, PPL, ACCURACY = "loss", "ppl", "accuracy"
BLEU, BLEU_LC = "bleu", "bleu_lc"  # seq2seq, with train.eval_bleu not 0
CHRF, TER = "chrf", "ter"  # sacreBLEU's chrF2 and TER, beside BLEU
BPC, WORD_PPL = "bpc", "word_ppl"  # lm, with data.unit characters or words

HIGHER_IS_BETTER = {
    LOSS: False,
    PPL: False,
    ACCURACY: True,
    BLEU: True,
    BLEU_LC: True,
    CHRF: True,
    TER: False,  # an edit rate: lower is better
    BPC: False,
    WORD_PPL: False,
}
UNIT = {BPC: "characters", WORD_PPL: "words"}  # the data.unit each is counted in

TRANSLATION = (BLEU, BLEU_LC, CHRF, TER)  # scored on the dev set's translations
SECONDS = "seconds"  # a validation's wall time, logged beside its metrics (not one to rank by)
PREFIX = "valid"


def tag(name: str) -> str:
    """The TensorBoard tag and manifest key of a validation metric."""
    return f"{PREFIX}/{name}"


VALID_TAGS = {tag(name): higher for name, higher in HIGHER_IS_BETTER.items()}
