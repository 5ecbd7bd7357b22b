"""Greedy decoding and per-token log-likelihood for a `Llama` (no KV cache: small demos/tests).

Every step reruns the model on a fixed-length buffer, so one compiled program serves the
whole completion; causal masking makes the not-yet-written tail irrelevant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsb.models.loss import next_token_loss


@nnx.jit
def _forward(model, tokens_BxT, segment_ids_BxT, positions_BxT):
    return model(tokens_BxT, segment_ids_BxT, positions_BxT)


def _single_row(tokens: list[int]) -> tuple[jax.Array, jax.Array, jax.Array]:
    T = len(tokens)
    return (jnp.asarray([tokens], jnp.int32), jnp.ones((1, T), jnp.int32),
            jnp.arange(T, dtype=jnp.int32)[None])


def sequence_logits(model, tokens: list[int]) -> np.ndarray:
    """float32 logits [T, V] for one document."""
    return np.asarray(_forward(model, *_single_row(tokens))[0])


def next_token_nll(model, tokens: list[int]) -> tuple[float, int]:
    """(sum of -log p(tokens[t+1] | tokens[:t+1]) over the document, number of predictions)."""
    toks, seg, pos = _single_row(tokens)
    logits = _forward(model, toks, seg, pos)
    targets = jnp.concatenate([toks[:, 1:], jnp.zeros((1, 1), jnp.int32)], axis=1)
    mask = jnp.concatenate([jnp.ones((1, len(tokens) - 1)), jnp.zeros((1, 1))], axis=1)
    total, count = next_token_loss(logits, targets, mask)
    return float(total), int(count)


def mean_next_token_nll(model, tokens: list[int]) -> float:
    """Mean next-token negative log-likelihood over the document; exp() of it is perplexity."""
    total, count = next_token_nll(model, tokens)
    return total / count


def greedy_generate(model, prompt: list[int], max_new_tokens: int, eos_id: int | None = None,
                    bucket: int = 32) -> list[int]:
    """Greedy continuation of `prompt` (new tokens only), stopping after `eos_id`."""
    if not prompt:
        raise ValueError("greedy_generate needs a non-empty prompt")
    length = -(-(len(prompt) + max_new_tokens) // bucket) * bucket
    buf = np.zeros((length,), np.int32)
    buf[: len(prompt)] = prompt
    _, seg, pos = _single_row([0] * length)
    n, out = len(prompt), []
    for _ in range(max_new_tokens):
        logits = _forward(model, jnp.asarray(buf[None]), seg, pos)
        nxt = int(jnp.argmax(logits[0, n - 1]))
        out.append(nxt)
        buf[n] = nxt
        n += 1
        if eos_id is not None and nxt == eos_id:
            break
    return out
