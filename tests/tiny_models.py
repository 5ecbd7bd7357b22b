"""A tiny Llama with random but deliberately large weights, shared by the model tests.

Weights are std ~0.3 with norm scales != 1, so that attention patterns and RoPE phases matter:
with the init std of 0.02 nearly everything would look uniform and a wrong mask or rotation
could hide.
"""

import numpy as np
from flax import nnx

from jaxsb.config import ModelConfig
from jaxsb.models import Llama
from jaxsb.models.pretrained import apply_pretrained, export_params

# GQA 2:1, T=20 with block 8: several blocks and a ragged last one
TINY = ModelConfig(vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=48,
                   rope_theta=10000.0, norm_eps=1e-5, attention="xla", attention_block=8)


def _randomise(params: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)

    def go(tree, path=()):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out[k] = go(v, path + (k,))
            elif k == "scale":
                out[k] = (1.0 + 0.2 * rng.standard_normal(v.shape)).astype(np.float32)
            else:
                fan_in = v.shape[0] if k == "kernel" else 1
                std = 0.5 if k == "embedding" else 1.2 / np.sqrt(fan_in)
                out[k] = (std * rng.standard_normal(v.shape)).astype(np.float32)
        return out

    return go(params)


def make_model(cfg: ModelConfig = TINY, seed: int = 0) -> tuple[Llama, dict]:
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    params = _randomise(export_params(model), seed)
    apply_pretrained(model, params)
    return model, params


