# Two commands do all the set-up on a fresh machine:
#   make demo   trains the offline demo end to end (tokenizer, model, test BLEU / exact match)
#   make test   passes the tests
# Each creates .venv (make install alone does only that) and installs torch before the project:
# with no torch installed, a loose requirement would pull several GB of CUDA packages even on a
# CPU-only machine. make test also creates .venv-bench (below): the HF export test loads its
# exports there with transformers.

VENV ?= .venv
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

# Where torch comes from. Where no CUDA device is seen (no nvidia-smi, or it lists no GPU),
# PyTorch's CPU wheels: PyPI's Linux torch is the CUDA build, several GB a CPU cannot use. With a
# GPU, pip's own index (PyPI: the CUDA build torch was released with). Override with another
# build's index, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cu128, or TORCH_INDEX= for
# pip's index whatever the machine. An index that does not answer (a machine that reaches only a
# mirror) is said so and pip's index used instead, rather than pip retrying it per package.
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
GPUS_SEEN := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
TORCH_INDEX ?= $(if $(filter 0,$(GPUS_SEEN)),$(CPU_TORCH_INDEX))

# $(call install_torch,VENV): torch $(TORCH_VERSION) into VENV, from TORCH_INDEX if it answers.
define install_torch
if [ -n "$(TORCH_INDEX)" ] && $(1)/bin/python -c 'import sys, urllib.request; \
	urllib.request.urlopen(sys.argv[1], timeout=15)' "$(TORCH_INDEX)/torch/" 2>/dev/null; then \
	$(1)/bin/python -m pip install --quiet torch==$(TORCH_VERSION) --index-url "$(TORCH_INDEX)"; \
else \
	if [ -n "$(TORCH_INDEX)" ]; then echo "$(TORCH_INDEX) does not answer: torch" \
		"$(TORCH_VERSION) from pip's index instead (from PyPI on Linux: the CUDA build)" >&2; fi; \
	$(1)/bin/python -m pip install --quiet torch==$(TORCH_VERSION); \
fi
endef

# The benchmarks' peers (transformers) live in a venv of their own: DeepSpeed and accelerate
# change behaviour when transformers is importable, so it never enters the training venv. The
# benchmarks (make bench) and tests/unit/test_export_hf.py (make test) share it.
BENCH_VENV ?= .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-$(TORCH_VERSION)

.PHONY: install prebuild-ops demo demo-lm demo-classify adapt backtranslation multi30k wmt14 wmt14-big tinyshakespeare wikitext2 test test-fast lint format clean-demo bench

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(call install_torch,$(VENV))
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: install
	$(BIN)/aiayn demo-data numbers --out data/demo/numbers
	$(BIN)/aiayn train --config configs/demo.yaml
	$(BIN)/aiayn evaluate --checkpoint runs/demo --split test

demo-lm: install
	$(BIN)/aiayn demo-data lm --out data/demo/lm
	$(BIN)/aiayn train --config configs/demo_lm.yaml
	$(BIN)/aiayn evaluate --checkpoint runs/demo_lm --split test
	$(BIN)/aiayn generate --checkpoint runs/demo_lm --prompt "forty-one forty-two" --temperature 0

demo-classify: install
	$(BIN)/aiayn demo-data classify --out data/demo/classify
	$(BIN)/aiayn train --config configs/demo_classify.yaml
	$(BIN)/aiayn evaluate --checkpoint runs/demo_classify --split test

# Fine-tuning with init.source, measured on the numbers demo (docs/recipes.md#fine-tuning):
# a model of 4-5 digit numbers adapted to 6-digit ones, against training from scratch.
adapt: install
	$(BIN)/python launch/adapt.py

# The Multi30k de->en recipe (data from ../shared/data/multi30k, or downloaded on first use into
# data/corpora: `aiayn data download multi30k`): tokenizer, training, checkpoint averaging and
# test BLEU, then a table. 20-25 minutes on 2 CPU cores.
multi30k: install
	$(BIN)/python launch/multi30k.py

# The paper's WMT 2014 en->de run (docs/recipes.md#wmt14-en-de), base or big, data from the
# Hugging Face Hub (wmt/wmt14): tokenizer, data prepare (download and token cache), training, the
# paper's checkpoint average (last 5 / 20), newstest2014 BLEU as sacreBLEU and as the paper
# scored it, then a table. GPUs: NPROC=8 trains on 8 of this machine's. An estimate, not yet
# run: base about 1.7 hours, big about 9 on one H200 (docs/recipes.md#wmt14-en-de).
NPROC ?= 1

wmt14: install
	$(BIN)/python launch/wmt14.py --nproc $(NPROC)

wmt14-big: install
	$(BIN)/python launch/wmt14.py --big --nproc $(NPROC)

# Back-translation on Multi30k de->en (docs/recipes.md#back-translation; data as for multi30k):
# half the parallel data, the other half's English back-translated by an en->de model, mixed in
# tagged and untagged, against half and all of the parallel data. About an hour on 2 CPU cores.
backtranslation: install
	$(BIN)/python launch/backtranslation.py

# The language-model recipes (data from ../shared/data, or downloaded on first use into
# data/corpora): split, tokenizer, training, whole-split scores (bits per character; word-level
# perplexity), a sample. About 30 minutes each on 2 cores.
tinyshakespeare: install
	$(BIN)/python launch/lm_recipe.py tinyshakespeare

wikitext2: install
	$(BIN)/python launch/lm_recipe.py wikitext2

# Three passes. The tests of one process run side by side, one per core (pytest-xdist; most of
# them keep one core busy, and each worker gets its share of the cores, tests/conftest.py), a
# module's tests on one worker (loadscope): a module's fixture (a trained run) is made once.
# The multi-process ones (distributed) follow, DIST_WORKERS modules at a time: their ranks
# wait on each other and on process start-up, so two at a time keep 2 cores 90% busy and
# take 20% less time than one at a time (docs/development.md#tests). The Slurm tests come
# last, alone: a loaded machine delays their two-node rendezvous and signals. Each pass runs
# whatever the one before reported. PYTEST_ARGS reaches all three, e.g.
# PYTEST_ARGS="--cpu-kind avx2" (tests/cpu_kinds.py). Each pass ends with its slowest tests
# and the tests that took the most CPU, theirs and their processes' (DURATIONS of each:
# tests/cpu_seconds.py), so that a CI log shows where the suite's time goes.
PYTEST_ARGS ?=
DIST_WORKERS ?= 2
DURATIONS ?= 15

# The sources are byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (CI), every process
# the tests start would compile each aiayn module it imports, about 0.1 s of CPU a process.
test: install prebuild-ops $(BENCH_STAMP)
	$(BIN)/python -m compileall -q src tests > /dev/null
	status=0; \
	$(BIN)/pytest -q -n auto --dist loadscope -m "not distributed and not slurm" --durations=$(DURATIONS) \
		$(PYTEST_ARGS) || status=1; \
	$(BIN)/pytest -q -n $(DIST_WORKERS) --dist loadfile -m "distributed and not slurm" \
		--durations=$(DURATIONS) $(PYTEST_ARGS) || status=1; \
	$(BIN)/pytest -q -m slurm --durations=$(DURATIONS) $(PYTEST_ARGS) || status=1; \
	exit $$status

# DeepSpeed's CPU Adam, compiled in the background while the benchmark environment installs
# and the first pass runs (tests/prebuild_ops.py); its output in .cache/prebuild_ops.log.
prebuild-ops: install
	mkdir -p .cache
	$(BIN)/python tests/prebuild_ops.py > .cache/prebuild_ops.log 2>&1 &

test-fast: install
	$(BIN)/pytest -q -n auto -m "not slow and not distributed and not slurm" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff format --check src tests benchmarks launch docs
	$(BIN)/ruff check src tests benchmarks launch docs

format: install
	$(BIN)/ruff format src tests benchmarks launch docs
	$(BIN)/ruff check --fix src tests benchmarks launch docs

$(BENCH_STAMP): pyproject.toml
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(call install_torch,$(BENCH_VENV))
	$(BENCH_VENV)/bin/python -m pip install --quiet -e ".[bench]"
	touch $@

bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/throughput.py
	$(BENCH_VENV)/bin/python benchmarks/data_pipeline.py
	$(BENCH_VENV)/bin/python benchmarks/kernels.py

clean-demo:
	rm -rf runs/demo runs/demo_lm runs/demo_classify data/demo
