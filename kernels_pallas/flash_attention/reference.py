"""Dense jnp attention: the oracle every other implementation is compared against.

Materialises the full [T, T] score matrix, so it is only for tests and short sequences.
Shapes: q [B,T,H,D], k/v [B,T,K,D] with H % K == 0; query head h reads kv head h // (H // K).
"""

import math

import jax
import jax.numpy as jnp


def attention_mask(segment_ids_BxT, T: int, causal: bool, batch: int) -> jax.Array:
    """[B, T, T] bool: token i may attend to token j (same segment, and j <= i if causal)."""
    mask = jnp.ones((batch, T, T), dtype=bool)
    if segment_ids_BxT is not None:
        mask = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    if causal:
        mask = mask & jnp.tril(jnp.ones((T, T), dtype=bool))[None]
    return mask


def attention_reference(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT=None, causal=True):
    """softmax(q k^T / sqrt(D) + mask) v, all arithmetic in float32, output in q's dtype."""
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxTxKxD.shape[2]
    G = H // K
    hi = jax.lax.Precision.HIGHEST
    q = q_BxTxHxD.astype(jnp.float32).reshape(B, T, K, G, D)
    k = k_BxTxKxD.astype(jnp.float32)
    v = v_BxTxKxD.astype(jnp.float32)
    s_BxKxGxTxT = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=hi) / math.sqrt(D)
    mask = attention_mask(segment_ids_BxT, T, causal, B)[:, None, None]
    s_BxKxGxTxT = jnp.where(mask, s_BxKxGxTxT, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s_BxKxGxTxT, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, precision=hi)
    return out.reshape(B, T, H, D).astype(q_BxTxHxD.dtype)

