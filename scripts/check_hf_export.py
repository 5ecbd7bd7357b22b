"""Checks jaxsb's Hugging Face export with transformers itself (not run by the tests: CI has no
torch). Exports every checkpoint of tests/models/hf_fixtures through `python -m jaxsb.export`,
then, in an environment with transformers (see scripts/make_hf_fixtures.py), loads each export
with AutoModelForCausalLM and AutoTokenizer and compares transformers' logits with the
fixture's reference (transformers' logits of the original checkpoint):

    .venv/bin/python scripts/check_hf_export.py export /tmp/jaxsb-export [CASE ...]
    /tmp/hf/bin/python scripts/check_hf_export.py check /tmp/jaxsb-export

Prints one line per checkpoint and `all N exports match` (exit 0) or the mismatches (exit 1).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "models", "hf_fixtures")
RTOL, ATOL = 1e-4, 1e-3  # tests/tolerances.py ("model_logits", float32)


def export(out: str, *only: str) -> int:
    cases = sorted(c for c in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, c)))
    for case in only or cases:
        proc = subprocess.run([sys.executable, "-m", "jaxsb.export", "--set", f"model.init=hf:{FIXTURES}/{case}",
                               "--out", os.path.join(out, case)], cwd=REPO, capture_output=True, text=True)
        print(case, "exported" if proc.returncode == 0 else proc.stderr[-2000:])
        if proc.returncode:
            return 1
    return 0


def check(out: str) -> int:
    import torch
    import transformers

    bad = []
    cases = sorted(os.listdir(out))
    for case in cases:
        ref = np.load(os.path.join(FIXTURES, case, "reference.npz"))
        major = int(transformers.__version__.split(".")[0])
        dtype = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, case), **dtype).eval()
        tok = transformers.AutoTokenizer.from_pretrained(os.path.join(out, case))
        with torch.no_grad():
            logits = model(torch.tensor(ref["ids"][None])).logits[0].numpy()[ref["rows"]]
        err = np.abs(logits - ref["logits"]) - (ATOL + RTOL * np.abs(ref["logits"]))
        ok = bool((err <= 0).all()) and tok("hi there").input_ids == [ord("h") - 32, ord("i") - 32, 0] + \
            [ord(c) - 32 for c in "there"]
        print(f"{case}: transformers {transformers.__version__} {type(model).__name__}, max |logit diff| "
              f"{np.abs(logits - ref['logits']).max():.2e}, tokenizer {'ok' if ok else 'MISMATCH'}")
        if not ok:
            bad.append(case)
    print(f"all {len(cases)} exports match" if not bad else f"mismatch: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit({"export": export, "check": check}[sys.argv[1]](*sys.argv[2:]))
