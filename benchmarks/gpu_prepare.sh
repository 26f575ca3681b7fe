#!/usr/bin/env bash
# On the development machine, before a GPU lease: what gpu_session.sh needs that the lent image
# lacks, in the two folders the device tool can carry (both ignored by git, through
# .git/info/exclude):
#   .whl/           wheels for the image's Python 3.12: datasets and DeepSpeed with the
#                   dependencies the image did not have on 2026-11-26
#   .gpu/multi30k/  the Multi30k files, for gpu_session.sh's train and decode stages
# Then: device run, carry [".whl", ".gpu"], command `bash benchmarks/gpu_session.sh STAGES...`.
set -eu
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for path in /.whl/ /.gpu/; do
    grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >>"$exclude"
done
PIP=${PIP:-python3 -m pip}
mkdir -p .whl .gpu
$PIP download -q -d .whl --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 hjson==3.1.0 pydantic==2.14.4 \
    pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
# DeepSpeed is published as source only: its wheel is pure Python once built (no ops compiled).
$PIP wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
corpus=${CORPUS:-../shared/data/multi30k}
if [ -d "$corpus" ]; then
    rm -rf .gpu/multi30k && cp -r "$corpus" .gpu/multi30k && chmod -R u+w .gpu/multi30k
else
    echo "no Multi30k at $corpus (set CORPUS): the train and decode stages will have none" >&2
fi
du -sh .whl .gpu
