"""The validation metrics, by name: computed by evaluate.py and lm_eval.py, logged to
TensorBoard as valid/<name>, recorded in a checkpoint's manifest under the same tag, and ranked
by checkpoint.best_metric (config/schema.py). One definition, so the four cannot drift apart."""

LOSS, PPL, ACCURACY = "loss", "ppl", "accuracy"
BLEU, BLEU_LC = "bleu", "bleu_lc"  # seq2seq, with train.eval_bleu > 0
BPC, WORD_PPL = "bpc", "word_ppl"  # lm, with data.unit characters or words

HIGHER_IS_BETTER = {
    LOSS: False,
    PPL: False,
    ACCURACY: True,
    BLEU: True,
    BLEU_LC: True,
    BPC: False,
    WORD_PPL: False,
}
UNIT = {BPC: "characters", WORD_PPL: "words"}  # the data.unit each is counted in

PREFIX = "valid"


def tag(name: str) -> str:
    """The TensorBoard tag and manifest key of a validation metric."""
    return f"{PREFIX}/{name}"


VALID_TAGS = {tag(name): higher for name, higher in HIGHER_IS_BETTER.items()}
