#!/usr/bin/env bash
# `accelerate launch` as the launcher (it sets torchrun's environment); aiayn's own engine
# trains. Usage: launch/accelerate.sh ACCELERATE_YAML CONFIG [key=value ...]
#   e.g. launch/accelerate.sh configs/accelerate/ddp_2proc.yaml configs/demo.yaml
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 ACCELERATE_YAML CONFIG [key=value ...]" >&2; exit 2; }
acc=$1 config=$2; shift 2
cmd=(accelerate launch --config_file "$acc" -m aiayn train --config "$config" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
