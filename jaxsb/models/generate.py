"""Per-token logits and log-likelihood of one document under a `Llama` (a full forward, no
cache: the reference for jaxsb/models/decode.py), and greedy decoding through that module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsb.models.loss import next_token_loss
from jaxsb.models.stats import host_scalars, pop_layer_stats


@nnx.jit
def _forward(model, tokens_BxT, segment_ids_BxT, positions_BxT):
    """(float32 logits [B,T,V], the layers' statistics: models/stats.py)."""
    logits_BxTxV = model(tokens_BxT, segment_ids_BxT, positions_BxT)
    return logits_BxTxV, pop_layer_stats(model)


def _single_row(tokens: list[int]) -> tuple[jax.Array, jax.Array, jax.Array]:
    T = len(tokens)
    return (jnp.asarray([tokens], jnp.int32), jnp.ones((1, T), jnp.int32),
            jnp.arange(T, dtype=jnp.int32)[None])


def sequence_logits(model, tokens: list[int]) -> np.ndarray:
    """float32 logits [T, V] for one document."""
    return np.asarray(_forward(model, *_single_row(tokens))[0][0])


@nnx.jit
def _argmax_forward(model, tokens_BxT, segment_ids_BxT, positions_BxT):
    logits_BxTxV, stats = _forward(model, tokens_BxT, segment_ids_BxT, positions_BxT)
    return jnp.argmax(logits_BxTxV, axis=-1).astype(jnp.int32), stats


def predicted_tokens(model, tokens_BxT: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """(argmax next-token predictions [B,T] int32 for rows of one document each, the layers'
    scalar statistics)."""
    B, T = tokens_BxT.shape
    pred, stats = _argmax_forward(model, jnp.asarray(tokens_BxT, jnp.int32), jnp.ones((B, T), jnp.int32),
                                  jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    return np.asarray(pred), host_scalars(stats)


def scored_nll(model, tokens: list[int]) -> tuple[float, int, dict[str, float]]:
    """(sum of -log p(tokens[t+1] | tokens[:t+1]) over the document, number of predictions,
    the layers' scalar statistics: the sparse router's, empty when dense)."""
    toks, seg, pos = _single_row(tokens)
    logits, stats = _forward(model, toks, seg, pos)
    targets = jnp.concatenate([toks[:, 1:], jnp.zeros((1, 1), jnp.int32)], axis=1)
    mask = jnp.concatenate([jnp.ones((1, len(tokens) - 1)), jnp.zeros((1, 1))], axis=1)
    total, count = next_token_loss(logits, targets, mask)
    return float(total), int(count), host_scalars(stats)


def next_token_nll(model, tokens: list[int]) -> tuple[float, int]:
    """(sum of -log p(tokens[t+1] | tokens[:t+1]) over the document, number of predictions)."""
    return scored_nll(model, tokens)[:2]


def mean_next_token_nll(model, tokens: list[int]) -> float:
    """Mean next-token negative log-likelihood over the document; exp() of it is perplexity."""
    total, count = next_token_nll(model, tokens)
    return total / count


def greedy_generate(model, prompt: list[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
    """Greedy continuation of one prompt (new tokens only, stopping after `eos_id`), with a KV
    cache (jaxsb/models/decode.py)."""
    from jaxsb.models.decode import generate

    if not prompt:
        raise ValueError("greedy_generate needs a non-empty prompt")
    return generate(model, [prompt], max_new_tokens, eos_id=eos_id).tokens[0]
