#!/usr/bin/env bash
# The GPU checks of one short lease of a GPU machine, in stages, each under its own time limit,
# so that one failing or slow stage leaves the others' figures:
#
#   benchmarks/gpu_session.sh env mfu tests nccl        # then: compile train decode
#
# env      GPU, driver, package versions; imports the project
# mfu      benchmarks/mfu.py eager, base and big, 25k tokens, three attention kernels, a
#          profile of 3 steps of each row
# compile  benchmarks/mfu.py train.compile rows (compiling takes a minute or more)
# tests    pytest -m gpu tests/gpu: the engines on CUDA, fp16 loss scaling, a bitwise resume
# nccl     whether NCCL lets two ranks share one GPU (the trainer refuses it before NCCL does)
# train    benchmarks/gpu_train.py: transformer_base bf16 on Multi30k from the token cache:
#          data wait, checkpoint blocking, tokens/s, MFU in the real trainer
# scale    benchmarks/scale.py on the GPU, transformer_big under ZeRO-3: how far the CUDA memory
#          allocated rises during a save and during a validation, against the model's size
# decode   aiayn translate (beam 4, batch 32) on the GPU, and the same model exported to
#          Hugging Face transformers
#
# Logs and profiles go to LOGS (default runs/bench/gpu_session); where $OUT is set (a lent
# machine's folder of files to bring back) they are also packed into $OUT/gpu_session.tgz
# after every stage, so a stage stopped by the lease's limit leaves the others'. Python packages
# the machine lacks can travel as wheels in .whl/ (installed to /tmp/site); Multi30k in
# .gpu/multi30k (else ../shared/data/multi30k): benchmarks/gpu_prepare.sh makes both on the
# development machine (the image lent on 2026-11-26, torch 2.11 and Python 3.12, lacked
# datasets and DeepSpeed and some of their dependencies).
set -u
cd "$(dirname "$0")/.."
LOGS=${LOGS:-runs/bench/gpu_session}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
PY=${PY:-python3}
CORPUS=.gpu/multi30k
[ -d "$CORPUS" ] || CORPUS=../shared/data/multi30k
WORK=${WORK:-/tmp/gpu_session}
mkdir -p "$WORK"

run_stage() {  # NAME SECONDS COMMAND...: log to $LOGS/NAME.log, print its tail and the verdict
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout --signal=KILL "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$LOGS/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/gpu_session.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
    fi
}

stage_env() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for name in ["deepspeed", "datasets", "pyarrow", "fsspec", "huggingface_hub", "transformers",
             "accelerate", "sentencepiece", "tensorboard", "sacrebleu", "safetensors", "pydantic"]:
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "FAILED:", type(exc).__name__, exc)
import aiayn.train  # noqa
print("aiayn imports")
EOF
}

stage_decode() {
    local run=$WORK/train/run src=$CORPUS/test_2016_flickr.de.gz
    $PY benchmarks/decode_speed.py --device cuda --checkpoint "$run" --input "$src" \
        --beam 4 --batch-size 32 --repeats 3 || return
    $PY -m aiayn translate --checkpoint "$run" --device cuda --input <(zcat "$src") \
        --output "$WORK/aiayn.hyp" decode.batch_size=32 decode.beam=4 || return
    rm -rf "$WORK/hf"
    $PY -m aiayn export --format hf --output "$WORK/hf" "$run" || return
    $PY benchmarks/hf_generate.py --model "$WORK/hf" --input "$src" --device cuda --beam 4 \
        --batch-size 32 --repeats 3 --compare "$WORK/aiayn.hyp"
}

export -f stage_env stage_decode  # timeout runs programs: these run in a bash of their own
export PY WORK CORPUS
for stage in "$@"; do
    case $stage in
    env) run_stage env 90 bash -c stage_env ;;
    mfu) run_stage mfu 150 $PY benchmarks/mfu.py --modes eager --max-tokens 25000 \
        --attention-kernels auto efficient math --profile "$LOGS" ;;
    compile) run_stage compile 240 $PY benchmarks/mfu.py --modes compile --max-tokens 25000 \
        --warmup 12 ;;
    tests) TAIL=60 run_stage tests 300 $PY -m pytest -m gpu tests/gpu -n 8 -p no:cacheprovider \
        -rA --durations=0 -q --basetemp="$WORK/pytest" ;;
    nccl) run_stage nccl 60 $PY benchmarks/nccl_shared_gpu.py ;;
    train) run_stage train 180 $PY benchmarks/gpu_train.py --corpus "$CORPUS" \
        --workdir "$WORK/train" --out "$LOGS" ;;
    scale) run_stage scale 120 $PY benchmarks/scale.py --world 1 --device cuda \
        --preset transformer_big --zero 3 --pairs 4000 --workdir "$WORK/scale" ;;
    decode) run_stage decode 200 bash -c stage_decode ;;
    *) echo "unknown stage $stage" ;;
    esac
done
