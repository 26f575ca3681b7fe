"""Inference with a torch model: greedy and beam search, sampling (decode.py), translating
sentences (translate.py) and files across ranks (translate_file.py), continuing prompts
(generate.py), and decoding ZeRO-3's partitioned model in step (lockstep.py). Below eval/ and
export/: both decode with it."""
