"""Optimiser pieces: warm-up + cosine schedule and the weight-decay mask."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxsb.config import TrainConfig
from jaxsb.training.optim import learning_rate_schedule, make_optimizer, weight_decay_mask


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, lr=1e-2, warmup_steps=10, min_lr_ratio=0.1)
    lr = learning_rate_schedule(cfg)
    np.testing.assert_allclose([float(lr(s)) for s in (0, 5, 10)], [0.0, 5e-3, 1e-2], rtol=1e-6)
    values = [float(lr(s)) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:])), "cosine part must not increase"
    np.testing.assert_allclose(float(lr(100)), 1e-3, rtol=1e-6)


def test_weight_decay_mask_skips_embeddings_and_norm_scales():
    params = {"embed": {"embedding": jnp.ones((8, 4))},
              "layers": {0: {"attn_norm": {"scale": jnp.ones((4,))},
                             "attn": {"q_proj": {"kernel": jnp.ones((4, 4))}}}},
              "lm_head": {"kernel": jnp.ones((4, 8))}}
    mask = weight_decay_mask(params)
    assert mask["embed"]["embedding"] is False
    assert mask["layers"][0]["attn_norm"]["scale"] is False
    assert mask["layers"][0]["attn"]["q_proj"]["kernel"] is True
    assert mask["lm_head"]["kernel"] is True


def test_decay_applies_only_where_masked():
    cfg = TrainConfig(steps=10, lr=1.0, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.5, grad_clip=1.0)
    tx = make_optimizer(cfg)
    params = {"embed": {"embedding": jnp.full((2, 2), 2.0)}, "w": {"kernel": jnp.full((2, 2), 2.0)}}
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    # zero gradients: only the decayed kernel moves, by -lr * wd * param
    np.testing.assert_allclose(updates["embed"]["embedding"], 0.0)
    np.testing.assert_allclose(updates["w"]["kernel"], -1.0)


def test_warmup_longer_than_the_run_is_clamped_to_the_run():
    lr = learning_rate_schedule(TrainConfig(steps=4, lr=1e-2, warmup_steps=10))
    np.testing.assert_allclose([float(lr(s)) for s in (0, 2, 4)], [0.0, 5e-3, 1e-2], rtol=1e-6)
