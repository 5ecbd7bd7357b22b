#!/usr/bin/env bash
# Runs the Bazel fast subset (in every //:test_*, the tests not marked slow or multiprocess) on
# the project's venv python, offline. Installs Debian's Bazel 4.2.3 through apt if `bazel` is
# missing (needs root or sudo).
# Arguments: target patterns (//:test_config) replace //...; anything else is passed to
# `bazel test` (e.g. --test_env=JAXSB_PYTEST_MARKERS= to include the slow and multiprocess tests).
# Bazel's output base stays in ~/.cache/bazel; only the gitignored bazel-* symlinks appear here.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if ! command -v bazel >/dev/null 2>&1; then
  echo "bazel_test: installing bazel-bootstrap and bazel-rules-java through apt"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "bazel_test: need root or sudo to install bazel" >&2; exit 1; }
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq bazel-bootstrap bazel-rules-java
fi
if [ ! -d /usr/share/bazel/rules/java ]; then
  echo "bazel_test: /usr/share/bazel/rules/java missing; install bazel-rules-java" >&2
  exit 1
fi

python="${JAXSB_BAZEL_PYTHON:-$root/.venv/bin/python}"
if [ ! -x "$python" ]; then
  bash scripts/setup.sh
fi

echo "bazel_test: $(bazel --version 2>/dev/null || echo bazel), python $python"
targets=()
options=()
for arg in "$@"; do
  case "$arg" in
    //*|@*) targets+=("$arg") ;;
    *) options+=("$arg") ;;
  esac
done
[ "${#targets[@]}" -gt 0 ] || targets=(//...)

start=$SECONDS
set +e
bazel test --config=fast --python_path="$python" "${options[@]}" -- "${targets[@]}"
rc=$?
set -e
echo "bazel_test: bazel test exited $rc after $((SECONDS - start)) s"
exit "$rc"
