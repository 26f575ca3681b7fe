"""Evaluation: the scores (scores.py; a language model's whole-text scores, lm_scores.py; the
paper's tokenized, compound-split BLEU, paper_bleu.py), validation during training
(validation.py), the `aiayn evaluate` command (evaluate.py) and the end of a run, checkpoints
averaged and scored (finish.py)."""
