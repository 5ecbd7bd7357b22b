#!/usr/bin/env bash
# Train on several GPU nodes with SLURM: set up the environment once on the shared filesystem
# (.venv with jax's CUDA 12 wheels: `scripts/setup.sh --runtime gpu`), then start one
# `python -m jaxsb.train` per node with all its GPUs and parallel.coordinator=auto (jax reads
# SLURM's environment: the coordinator, the number of processes and this one's index). Run it from
# this checkout, on a filesystem every node sees; `--workdir` too. Compile for the nodes first:
#   .venv-targets/bin/python -m jaxsb.compile --target gpu-h100:8x4 [same --config/--set]
#
# usage: scripts/launch_slurm.sh [--dry-run] --nodes N [--gpus-per-node 8] [--partition P]
#            [--time HH:MM:SS] [--workdir DIR] [-- ARGS FOR jaxsb.train ...]
# --dry-run prints exactly the commands it would run, and runs nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dry=0 nodes="" gpus=8 partition="" limit="" workdir="" train_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift ;;
    --nodes) nodes="$2"; shift 2 ;;
    --gpus-per-node) gpus="$2"; shift 2 ;;
    --partition) partition="$2"; shift 2 ;;
    --time) limit="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --) shift; train_args=("$@"); break ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "launch_slurm.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || ! [[ "$gpus" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch_slurm.sh: --nodes N (and --gpus-per-node G) must be positive integers (see --help)" >&2
  exit 2
fi
workdir="${workdir:-runs/slurm-${nodes}x${gpus}}"
opts=()
[ -n "$partition" ] && opts+=(--partition="$partition")
[ -n "$limit" ] && opts+=(--time="$limit")

run() {
  if [ "$dry" = 1 ]; then
    local line
    line="$(printf '%q ' "$@")"
    echo "${line% }"
  else
    "$@"
  fi
}
cd "$root"
run srun "${opts[@]}" --nodes=1 --ntasks=1 bash scripts/setup.sh --runtime gpu
run srun "${opts[@]}" --nodes="$nodes" --ntasks-per-node=1 --gpus-per-node="$gpus" \
  .venv/bin/python -m jaxsb.train --set parallel.coordinator=auto --workdir "$workdir" "${train_args[@]}"
