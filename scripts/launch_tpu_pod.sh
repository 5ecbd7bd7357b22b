#!/usr/bin/env bash
# Train on a Cloud TPU VM slice: copy this checkout to every worker, set up its environment there
# (.venv with libtpu: `scripts/setup.sh --runtime tpu`), then start `python -m jaxsb.train` on all
# workers at once with parallel.coordinator=auto (the TPU runtime tells each worker the
# coordinator and its index). `--workdir` must be on storage every worker sees (checkpoints are
# written by every host). Compile for the slice first, from any machine:
#   .venv-targets/bin/python -m jaxsb.compile --target tpu-v5p:4x4x4 [same --config/--set]
#
# usage: scripts/launch_tpu_pod.sh [--dry-run] --tpu NAME --zone ZONE [--project ID]
#            [--workdir DIR] [-- ARGS FOR jaxsb.train ...]
# --dry-run prints exactly the commands it would run, and runs nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dry=0 tpu="" zone="" project="" workdir="" train_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift ;;
    --tpu) tpu="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --) shift; train_args=("$@"); break ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "launch_tpu_pod.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$tpu" ] || [ -z "$zone" ]; then
  echo "launch_tpu_pod.sh: --tpu NAME and --zone ZONE are required (see --help)" >&2
  exit 2
fi
workdir="${workdir:-runs/$tpu}"
gcloud=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[ -n "$project" ] && where+=(--project="$project")
archive="/tmp/jaxsb-$tpu.tar.gz"
remote_dir="jaxsb"
train="cd $remote_dir && .venv/bin/python -m jaxsb.train --set parallel.coordinator=auto --workdir $(printf %q "$workdir")"
for a in "${train_args[@]}"; do train+=" $(printf %q "$a")"; done

run() {
  if [ "$dry" = 1 ]; then
    local line
    line="$(printf '%q ' "$@")"
    echo "${line% }"
  else
    "$@"
  fi
}
run git -C "$root" archive --format=tar.gz -o "$archive" HEAD
run "${gcloud[@]}" scp "${where[@]}" --worker=all "$archive" "$tpu:jaxsb.tar.gz"
run "${gcloud[@]}" ssh "$tpu" "${where[@]}" --worker=all \
  --command="mkdir -p $remote_dir && tar -xzf jaxsb.tar.gz -C $remote_dir && cd $remote_dir && bash scripts/setup.sh --runtime tpu"
run "${gcloud[@]}" ssh "$tpu" "${where[@]}" --worker=all --command="$train"
