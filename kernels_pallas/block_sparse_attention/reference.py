"""Dense jnp oracle for block-sparse attention: builds the whole [B, K, T, T] mask.

Token i (query block i // block_size) sees token j iff key block j // block_size is among the
valid entries of that query block's list (the first `block_counts` slots; duplicates count
once, out-of-range indices select nothing), j <= i, and both carry the same segment id.
A row that sees nothing outputs zeros (the kernels agree; the router never produces one since
it always selects the diagonal block, where every token sees itself).

Shapes: q [B,T,H,D], k/v [B,T,K,D] (H % K == 0, query head h reads kv head h // (H // K)),
block_indices [B,K,nq,max_blocks], block_counts [B,K,nq], nq = ceil(T / block_size).
Only for tests and short sequences: O(T^2) memory.
"""

import math

import jax
import jax.numpy as jnp


def selected_blocks(block_indices_BxKxNxM, block_counts_BxKxN, num_key_blocks: int) -> jax.Array:
    """[B, K, nq, nk] bool: key block j is a valid entry of query block n's list."""
    M = block_indices_BxKxNxM.shape[-1]
    valid = jnp.arange(M) < jnp.clip(block_counts_BxKxN, 0, M)[..., None]
    one_hot = jax.nn.one_hot(block_indices_BxKxNxM, num_key_blocks, dtype=jnp.bool_)
    return (one_hot & valid[..., None]).any(axis=-2)


def block_sparse_mask(block_indices, block_counts, segment_ids_BxT, T: int, block_size: int):
    """[B, K, T, T] bool: selected block & causal & same segment (None: one document)."""
    B, K = block_counts.shape[:2]
    nk = -(-T // block_size)
    sel_BxKxNxN = selected_blocks(block_indices, block_counts, nk)
    blk = jnp.arange(T) // block_size
    mask = sel_BxKxNxN[:, :, blk][:, :, :, blk]  # [B, K, T, T]
    mask = mask & jnp.tril(jnp.ones((T, T), dtype=bool))
    if segment_ids_BxT is not None:
        same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
        mask = mask & same_BxTxT[:, None]
    return jnp.broadcast_to(mask, (B, K, T, T))


def block_sparse_attention_reference(
    q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, block_indices, block_counts, segment_ids_BxT=None,
    block_size: int = 128,
):
    """softmax(q k^T / sqrt(D) + mask) v over the selected blocks; float32 inside."""
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxTxKxD.shape[2]
    G = H // K
    hi = jax.lax.Precision.HIGHEST
    q = q_BxTxHxD.astype(jnp.float32).reshape(B, T, K, G, D)
    k = k_BxTxKxD.astype(jnp.float32)
    v = v_BxTxKxD.astype(jnp.float32)
    s_BxKxGxTxT = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=hi) / math.sqrt(D)
    mask = block_sparse_mask(block_indices, block_counts, segment_ids_BxT, T, block_size)
    mask = mask[:, :, None]
    s_BxKxGxTxT = jnp.where(mask, s_BxKxGxTxT, jnp.finfo(jnp.float32).min)
    # `* mask` zeroes rows that see nothing (finite fill: no NaN in any gradient path).
    p = jax.nn.softmax(s_BxKxGxTxT, axis=-1) * mask
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, precision=hi)
    return out.reshape(B, T, H, D).astype(q_BxTxHxD.dtype)
