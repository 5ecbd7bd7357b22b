"""Export to the Hugging Face layout (jaxsb/models/hf_export.py, `python -m jaxsb.export`): a
model written and read back has the same config fields and parameters, so the logits of the
transformers-made checkpoints (tests/models/hf_fixtures) survive a round trip; the command line
writes a directory that loads with `model.init=hf:DIR`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxsb.config import ModelConfig
from jaxsb.models import Llama
from jaxsb.models.generate import sequence_logits
from jaxsb.models.hf_config import config_from_hf
from jaxsb.models.hf_export import write_hf_checkpoint
from jaxsb.models.pretrained import apply_pretrained, load_pretrained
from tolerances import tol

FIXTURES = Path(__file__).parent / "hf_fixtures"
REPO = Path(__file__).resolve().parents[2]


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield prefix + (k,), v


@pytest.mark.parametrize("case", ["llama-hf5", "llama-bias-hf5", "llama3-hf4", "llama-yarn-hf5", "qwen2-hf5",
                                  "qwen2-untied-hf4", "mistral-hf5"])
def test_round_trip_keeps_config_params_and_logits(tmp_path, case):
    pre = load_pretrained(f"hf:{FIXTURES / case}")
    cfg = ModelConfig(**pre.config)
    write_hf_checkpoint(tmp_path, cfg, pre.params, pre.tokenizer, pre.bos_id, pre.eos_id, max_positions=256)
    back = load_pretrained(f"hf:{tmp_path}")
    assert back.config == pre.config and (back.bos_id, back.eos_id) == (pre.bos_id, pre.eos_id)
    want, got = dict(_flat(pre.params)), dict(_flat(back.params))
    assert sorted(want) == sorted(got)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
    model = Llama(ModelConfig(**back.config), rngs=nnx.Rngs(0))
    apply_pretrained(model, back.params)
    ref = np.load(FIXTURES / case / "reference.npz")
    logits = sequence_logits(model, ref["ids"].tolist())
    np.testing.assert_allclose(logits[ref["rows"]], ref["logits"], **tol("model_logits", np.float32))
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == ("qwen2" if case.startswith("qwen2") else "llama")
    assert written["rope_parameters"]["rope_type"] == cfg.rope.scaling


def test_bfloat16_export_is_read_back_as_rounded_float32(tmp_path):
    import ml_dtypes

    pre = load_pretrained(f"hf:{FIXTURES / 'qwen2-hf5'}")
    write_hf_checkpoint(tmp_path, ModelConfig(**pre.config), pre.params, pre.tokenizer, pre.bos_id, pre.eos_id,
                        dtype="bfloat16")
    back = load_pretrained(f"hf:{tmp_path}")
    for k, v in _flat(pre.params):
        got = dict(_flat(back.params))[k]
        np.testing.assert_array_equal(got, v.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=str(k))


@pytest.mark.slow
def test_cli_exports_a_model_init(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "jaxsb.export", "--set", f"model.init=hf:{FIXTURES / 'qwen2-hf5'}",
                           "--out", str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "config.json" in proc.stdout and "model.safetensors" in proc.stdout
    assert config_from_hf(tmp_path / "out") == config_from_hf(FIXTURES / "qwen2-hf5")
    bad = subprocess.run([sys.executable, "-m", "jaxsb.export", "--set", f"model.init=hf:{tmp_path / 'missing'}",
                          "--out", str(tmp_path / "x")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "missing" in bad.stderr, bad.stderr[-2000:]
    (tmp_path / "t.txt").write_text("hello")
    bad = subprocess.run([sys.executable, "-m", "jaxsb.eval", "--set", f"model.init=hf:{tmp_path / 'missing'}",
                          "--text", str(tmp_path / "t.txt")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
