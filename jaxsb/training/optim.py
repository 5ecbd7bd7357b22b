"""Optimiser: AdamW with linear warm-up then cosine decay, global-norm clipping, and a
weight-decay mask that leaves norms' scales and embeddings undecayed (the usual LLaMA recipe).
"""

from __future__ import annotations

import jax
import optax

from jaxsb.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup_steps` (at most the whole run), then cosine
    down to `lr·min_lr_ratio` at the last step."""
    warmup = min(cfg.warmup_steps, cfg.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _path_names(path) -> list[str]:
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
    return names


def weight_decay_mask(params):
    """True for matrices that are decayed: every 2-D kernel except embeddings; never scales."""

    def decide(path, leaf):
        names = _path_names(path)
        return leaf.ndim >= 2 and "embed" not in names and "embedding" not in names

    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            learning_rate=learning_rate_schedule(cfg),
            b1=cfg.beta1,
            b2=cfg.beta2,
            weight_decay=cfg.weight_decay,
            mask=weight_decay_mask,
        ),
    )
