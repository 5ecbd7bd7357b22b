"""`configs/qwen2.5_sft.toml` on a tiny Qwen2 checkpoint made by transformers (q/k/v biases,
tests/models/hf_fixtures) with a ChatML template in its tokenizer files: the chat template is
read from the checkpoint, the planner lays out the conversations and trains the same model as
the rows path, and only assistant tokens are targets (which ones: tests/data/test_chat_template.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxsb.config import load_config
from jaxsb.models.hf_checkpoint import chat_template_from_hf
from jaxsb.training.trainer import train
from tolerances import tol

pytestmark = [pytest.mark.slow, pytest.mark.compiled]

FIXTURE = Path(__file__).resolve().parents[1] / "models" / "hf_fixtures" / "qwen2-hf5"
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _checkpoint_and_chats(tmp_path: Path) -> tuple[Path, Path]:
    ckpt = tmp_path / "qwen2"
    shutil.copytree(FIXTURE, ckpt)
    (ckpt / "chat_template.jinja").write_text(CHATML)  # where transformers 5 writes it
    import json.decoder

    source = open(json.decoder.__file__).read()
    rng = np.random.default_rng(0)
    with open(tmp_path / "chats.jsonl", "w") as f:
        for i in range(24):
            a, n = int(rng.integers(0, len(source) - 2000)), int(rng.integers(20, 600))
            messages = [{"role": "user", "content": f"Continue the code, part {i}."},
                        {"role": "assistant", "content": source[a:a + n]}]
            if i % 3 == 0:
                messages += [{"role": "user", "content": "More."},
                             {"role": "assistant", "content": source[a + n:a + 2 * n]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return ckpt, tmp_path / "chats.jsonl"


def test_qwen_sft_config_trains_assistant_tokens_through_the_planner(tmp_path):
    ckpt, chats = _checkpoint_and_chats(tmp_path)
    assert chat_template_from_hf(ckpt) == CHATML
    common = [f"model.init=hf:{ckpt}", f"data.path={chats}", "data.max_len=512", "data.tokens_per_step=2048",
              "data.row_buckets=[2048]", "train.steps=2", "train.checkpoint_every=100", "model.remat=false"]
    losses = {}
    for name, extra in (("planned", []), ("rows", ["parallel.planner=none"])):
        cfg = load_config("qwen2.5_sft", [*common, f"train.workdir={tmp_path / name}", *extra])
        assert cfg.parallel.planner == ("jaxsb" if name == "planned" else "none")
        train(cfg, log=lambda *_: None)
        with open(tmp_path / name / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        losses[name] = [r["loss"] for r in records]
        assert all(np.isfinite(losses[name]))
        assert all(0 < r["targets"] < 0.9 * r["tokens"] for r in records), "prompts and markup are not targets"
    np.testing.assert_allclose(losses["planned"], losses["rows"], **tol("planner_loss", np.float32))
    assert os.path.exists(tmp_path / "planned" / "checkpoints")
