"""Inference with a torch model: greedy search and LM sampling (decode.py), beam search with
n-best lists (beam.py), sampled and noised translations (sampling.py), ensembles (ensemble.py),
translating sentences (translate.py) and files across ranks (translate_file.py), continuing
prompts (generate.py), and decoding ZeRO-3's partitioned model in step (lockstep.py). Below
eval/ and export/: both decode with it."""
