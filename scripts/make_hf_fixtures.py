"""Writes the tiny Hugging Face checkpoints that tests/models/test_hf_families.py checks jaxsb
against, with Hugging Face transformers itself (random weights, each family's own config class,
weight names and `save_pretrained`), and transformers' own logits for them.

Not run by the tests (they read the shipped files, so CI needs neither torch nor
transformers). To regenerate, in a separate environment:

    python -m venv /tmp/hf && /tmp/hf/bin/pip install "torch==2.13.0+cpu" "transformers==5.24.0"
    /tmp/hf/bin/python scripts/make_hf_fixtures.py            # 5.x configs (rope_parameters)
    /tmp/hf/bin/pip install "transformers==4.57.6"
    /tmp/hf/bin/python scripts/make_hf_fixtures.py            # 4.x configs (rope_theta, rope_scaling)

Each case is a directory tests/models/hf_fixtures/<case>-hf<major>/ holding what
`save_pretrained` wrote (config.json, model.safetensors in float16), a character-level
tokenizer.json, and reference.npz: `ids` [T] (T beyond the original context of the scaled-RoPE
cases), `rows` (the positions whose logits are kept) and `logits` [len(rows), V] in float32, computed
by transformers in float32 from the float16 weights.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "models", "hf_fixtures")
CHARS = "".join(chr(c) for c in range(32, 127))  # 95 printable ASCII characters
VOCAB = len(CHARS) + 1  # + <|endoftext|>
T = 160  # tokens scored; the scaled cases were "pretrained" on 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=VOCAB - 1,
             eos_token_id=VOCAB - 1)

# case: (model class name, config class name, config fields, RoPE parameters as transformers 5 names them)
CASES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False),
              {"rope_type": "default", "rope_theta": 10000.0}),
    "llama-bias": ("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=True, tie_word_embeddings=True),
                   {"rope_type": "default", "rope_theta": 10000.0}),
    "llama-linear": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True),
                     {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True),
               {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-yarn": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True),
                   {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 64}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False),
              {"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen2-untied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=False, use_sliding_window=False),
                     {"rope_type": "default", "rope_theta": 1000000.0}),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(tie_word_embeddings=False, sliding_window=None),
                {"rope_type": "default", "rope_theta": 10000.0}),
}


def tokenizer() -> Tokenizer:
    vocab = {c: i for i, c in enumerate(CHARS)} | {"<|endoftext|>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return tok


def config(config_cls, fields: dict, rope: dict, major: int):
    if major >= 5:
        return config_cls(**SHAPE, **fields, rope_parameters=dict(rope))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return config_cls(**SHAPE, **fields, rope_theta=rope["rope_theta"],
                      rope_scaling=None if scaling["rope_type"] == "default" else scaling)


def main() -> int:
    major = int(transformers.__version__.split(".")[0])
    tok = tokenizer()
    for i, (case, (model_name, config_name, fields, rope)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        cfg = config(getattr(transformers, config_name), fields, rope, major)
        model = getattr(transformers, model_name)(cfg)
        with torch.no_grad():  # larger than the default init, so every layer visibly matters
            for p in model.parameters():
                p.normal_(0.0, 0.08) if p.dim() > 1 else p.uniform_(0.5, 1.5)
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.2)
        model = model.half().double()  # the float16 weights saved below
        directory = os.path.join(OUT, f"{case}-hf{major}")
        os.makedirs(directory, exist_ok=True)
        model.half().save_pretrained(directory)
        # The reference is what a user gets: the saved directory loaded back, in float32 (jaxsb
        # computes in float32 too). Not the in-memory model, whose RoPE buffers .half() rounded.
        dtype = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
        model = getattr(transformers, model_name).from_pretrained(directory, **dtype).eval()
        tok.save(os.path.join(directory, "tokenizer.json"))
        rng = np.random.default_rng(i)
        ids = rng.integers(0, VOCAB - 1, T)
        with torch.no_grad():
            logits = model(torch.tensor(ids[None])).logits[0].numpy().astype(np.float32)
        rows = np.arange(0, T, 5)
        np.savez(os.path.join(directory, "reference.npz"), ids=ids.astype(np.int32), rows=rows, logits=logits[rows])
        with open(os.path.join(directory, "config.json")) as f:
            written = json.load(f)
        print(f"{directory}: transformers {transformers.__version__}, "
              f"{sorted(k for k in written if 'rope' in k)}, {sum(p.numel() for p in model.parameters())} params")
    return 0


if __name__ == "__main__":
    sys.exit(main())
