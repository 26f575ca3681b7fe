#!/usr/bin/env bash
# One process (CPU, or one CUDA device when present).
# Usage: launch/single.sh CONFIG [key=value ...]
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 CONFIG [key=value ...]" >&2; exit 2; }
config=$1; shift
cmd=(python -m aiayn train --config "$config" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
