"""Dense jnp oracle of the ring's chunk op (ops.py), for tests and short chunks only.

Materialises the full [Lq, Lk] score matrix. Shapes: q [B, Lq, H, D], k/v [B, Lk, K, D] with
H % K == 0; query head h reads kv head h // (H // K).
"""

import math

import jax
import jax.numpy as jnp


def chunk_reference(q_BxLqxHxD, k_BxLkxKxD, v_BxLkxKxD, seg_q_BxLq, pos_q_BxLq, seg_k_BxLk,
                    pos_k_BxLk):
    """Dense oracle of the chunk op (ops.py): query i sees key j iff seg_q[i] == seg_k[j]
    and pos_k[j] <= pos_q[i], for any token order. Returns (out in q's dtype, lse float32
    [B, Lq, H]); a query that sees no key gets out 0 and lse -inf. Float32 arithmetic."""
    B, Lq, H, D = q_BxLqxHxD.shape
    K = k_BxLkxKxD.shape[2]
    hi = jax.lax.Precision.HIGHEST
    q = q_BxLqxHxD.astype(jnp.float32).reshape(B, Lq, K, H // K, D)
    k = k_BxLkxKxD.astype(jnp.float32)
    v = v_BxLkxKxD.astype(jnp.float32)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=hi) / math.sqrt(D)
    mask = ((seg_q_BxLq[:, :, None] == seg_k_BxLk[:, None, :])
            & (pos_k_BxLk[:, None, :] <= pos_q_BxLq[:, :, None]))[:, None, None]
    seen = mask.any(-1)  # [B, 1, 1, Lq]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.where(seen, s.max(-1), 0.0)  # finite shift, also for rows that see nothing
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    l = p.sum(-1)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    p = p / jnp.where(seen, l, 1.0)[..., None]
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, precision=hi).reshape(B, Lq, H, D)
    return out.astype(q_BxLqxHxD.dtype), lse.reshape(B, H, Lq).transpose(0, 2, 1)
