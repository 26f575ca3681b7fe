"""Inference with a torch model: greedy and beam search with n-best lists, LM sampling
(decode.py), sampled and noised translations (sampling.py), ensembles (ensemble.py),
translating sentences (translate.py) and files across ranks (translate_file.py), continuing
prompts (generate.py), and decoding ZeRO-3's partitioned model in step (lockstep.py). Below
eval/ and export/: both decode with it."""
