"""Block-sparse attention in pure JAX/XLA whose cost follows the block counts.

Each query block n of each (batch row b, kv head k) attends to the key blocks
`block_indices[b, k, n, :block_counts[b, k, n]]`. The forward loops over the list *slots*
(`lax.fori_loop` from 0 to max(block_counts), a traced bound: slots that no query block uses
are never visited, so the work is max(counts) x T x block_size, not max_blocks x ...). One slot
step handles every query block at once: it gathers each query block's key/value block for that
slot ([B, K, nq, bs, D]), computes scores as one batched matmul, masks (slot valid, causal,
same segment, key padding) and updates a float32 online softmax. The log-sum-exp is saved.

The backward (`jax.custom_vjp`, FlashAttention-2 formulas) walks the same slots, recomputes
p = exp(s - lse), accumulates dq in place (query blocks are never gathered) and scatter-adds
each slot's dk/dv block contributions into the selected key blocks.

Layout inside: q is [B, K, nq, G*bs, D] (G = H // K query heads of kv head k, the G heads and
the block's rows merged into one matmul dimension, so GQA's dk/dv sums over heads inside the
matmul), k/v are [B, K, nb, bs, D]. All arithmetic is float32; results are cast back.

Masked scores are -inf and the running max starts at the finite NEG, so masked entries give
exp(-inf) = 0 exactly, and a row that sees nothing keeps l = 0 and outputs 0 (like the
reference). Invalid slots (>= count) and duplicates of an earlier valid slot are masked;
their (clipped) indices still drive the gather, and scatter exact zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import NEG, HI as _HI, pad_axis



@dataclasses.dataclass(frozen=True)
class Plan:
    """Static blocking of one call."""

    T: int
    bs: int

    @property
    def nb(self) -> int:
        return -(-self.T // self.bs)

    @property
    def Tp(self) -> int:
        return self.nb * self.bs


def _pad_t(x, n, axis=1, mode="constant", value=0):
    return pad_axis(x, axis, n, mode, value)


def _slot_validity(idx_BxKxNxM, counts_BxKxN, M, nb):
    """[B,K,nq,M] bool: slot is below the count, names a block in [0, nb), and does not repeat
    an earlier valid slot. `idx` must be the caller's indices, before any clipping."""
    slot = jnp.arange(M)
    valid = (slot < counts_BxKxN[..., None]) & (idx_BxKxNxM >= 0) & (idx_BxKxNxM < nb)
    same = idx_BxKxNxM[..., :, None] == idx_BxKxNxM[..., None, :]  # [.., s, s']
    earlier = slot[None, :] < slot[:, None]  # s' < s
    dup = (same & earlier & valid[..., None, :]).any(-1)
    return valid & ~dup


def _prepare(q, k, v, seg, idx, counts, plan: Plan):
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    nb, bs = plan.nb, plan.bs
    scale = 1.0 / math.sqrt(D)
    qt = (_pad_t(q.astype(jnp.float32), plan.Tp) * scale).reshape(B, nb, bs, K, G, D)
    qt = qt.transpose(0, 3, 1, 4, 2, 5).reshape(B, K, nb, G * bs, D)
    kt = _pad_t(k.astype(jnp.float32), plan.Tp).reshape(B, nb, bs, K, D).transpose(0, 3, 1, 2, 4)
    vt = _pad_t(v.astype(jnp.float32), plan.Tp).reshape(B, nb, bs, K, D).transpose(0, 3, 1, 2, 4)
    seg_b = _pad_t(seg, plan.Tp, mode="edge").reshape(B, nb, bs)
    M = idx.shape[-1]
    counts = jnp.clip(counts.astype(jnp.int32), 0, M)
    idx = idx.astype(jnp.int32)
    valid = _slot_validity(idx, counts, M, nb)
    idx = jnp.clip(idx, 0, nb - 1)  # invalid slots still gather (a real block), masked out
    n_slots = counts.max()
    return qt, kt, vt, seg_b, idx, valid, n_slots


def _gather_blocks(x_BxKxNBx_, idx_BxKxN):
    """x[b, k, idx[b, k, n]] for every n: [B, K, nq, ...]."""
    return jax.vmap(jax.vmap(lambda x, i: x[i]))(x_BxKxNBx_, idx_BxKxN)


def _slot_mask(seg_b, idx_s, valid_s, plan: Plan, K):
    """[B, K, nq, 1, bs, bs] bool for one slot (broadcasts over the G heads)."""
    B, nb, bs = seg_b.shape
    seg_k = _gather_blocks(jnp.broadcast_to(seg_b[:, None], (B, K, nb, bs)), idx_s)
    mask = seg_b[:, None, :, :, None] == seg_k[:, :, :, None, :]
    qpos = jnp.arange(nb)[:, None, None] * bs + jnp.arange(bs)[None, :, None]  # [nq, bs, 1]
    kpos = idx_s[..., None, None] * bs + jnp.arange(bs)  # [B, K, nq, 1, bs]
    mask = mask & (kpos <= qpos) & valid_s[..., None, None]
    if plan.Tp > plan.T:
        mask = mask & (kpos < plan.T)
    return mask[:, :, :, None]


def _scores(qt, kb, mask, G, bs):
    B, K, nq, _, D = qt.shape
    s = jnp.einsum("bknmd,bknsd->bknms", qt, kb, precision=_HI).reshape(B, K, nq, G, bs, bs)
    return jnp.where(mask, s, -jnp.inf)


def _forward(q, k, v, seg, idx_in, counts_in, plan: Plan):
    """out [B,T,H,D] (q.dtype) and lse [B,K,nq,G,bs] (float32)."""
    qt, kt, vt, seg_b, idx, valid, n_slots = _prepare(q, k, v, seg, idx_in, counts_in, plan)
    B, K, nq, GB, D = qt.shape
    bs = plan.bs
    G = GB // bs

    def slot(s, carry):
        m, l, acc = carry  # [B,K,nq,G,bs], same, [B,K,nq,G,bs,D]
        idx_s, valid_s = idx[..., s], valid[..., s]
        kb, vb = _gather_blocks(kt, idx_s), _gather_blocks(vt, idx_s)
        sc = _scores(qt, kb, _slot_mask(seg_b, idx_s, valid_s, plan, K), G, bs)
        m_new = jnp.maximum(m, sc.max(-1))
        p = jnp.exp(sc - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        pv = jnp.einsum("bknms,bknsd->bknmd", p.reshape(B, K, nq, GB, bs), vb, precision=_HI)
        acc = alpha[..., None] * acc + pv.reshape(B, K, nq, G, bs, D)
        return m_new, l, acc

    init = (
        jnp.full((B, K, nq, G, bs), NEG, jnp.float32),
        jnp.zeros((B, K, nq, G, bs), jnp.float32),
        jnp.zeros((B, K, nq, G, bs, D), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, n_slots, slot, init)
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, NEG, m + jnp.log(jnp.where(empty, 1.0, l)))
    return _from_blocked_q(out, plan.T).astype(q.dtype), lse


def _from_blocked_q(x_BxKxNxGxBSxD, T):
    B, K, nq, G, bs, D = x_BxKxNxGxBSxD.shape
    return x_BxKxNxGxBSxD.transpose(0, 2, 4, 1, 3, 5).reshape(B, nq * bs, K * G, D)[:, :T]


def _to_blocked_q(x_BxTxHxD, K, plan: Plan):
    B, T, H, D = x_BxTxHxD.shape
    x = _pad_t(x_BxTxHxD.astype(jnp.float32), plan.Tp).reshape(B, plan.nb, plan.bs, K, H // K, D)
    return x.transpose(0, 3, 1, 4, 2, 5)  # [B, K, nq, G, bs, D]


def _backward(plan: Plan, res, do):
    q, k, v, seg, idx_in, counts_in, out, lse = res
    qt, kt, vt, seg_b, idx, valid, n_slots = _prepare(q, k, v, seg, idx_in, counts_in, plan)
    B, K, nq, GB, D = qt.shape
    bs = plan.bs
    G = GB // bs
    dot = _to_blocked_q(do, K, plan)  # padded rows get a zero cotangent
    delta = (dot * _to_blocked_q(out, K, plan)).sum(-1)  # rowsum(dO * O): [B,K,nq,G,bs]
    do_m = dot.reshape(B, K, nq, GB, D)
    b_ix = jnp.arange(B)[:, None, None]
    k_ix = jnp.arange(K)[None, :, None]

    def slot(s, carry):
        dq, dk, dv = carry
        idx_s, valid_s = idx[..., s], valid[..., s]
        kb, vb = _gather_blocks(kt, idx_s), _gather_blocks(vt, idx_s)
        sc = _scores(qt, kb, _slot_mask(seg_b, idx_s, valid_s, plan, K), G, bs)
        p = jnp.exp(sc - lse[..., None])  # masked: exp(-inf) == 0 exactly
        dp = jnp.einsum("bknmd,bknsd->bknms", do_m, vb, precision=_HI).reshape(p.shape)
        ds = (p * (dp - delta[..., None])).reshape(B, K, nq, GB, bs)
        p = p.reshape(B, K, nq, GB, bs)
        dv_s = jnp.einsum("bknms,bknmd->bknsd", p, do_m, precision=_HI)
        dk_s = jnp.einsum("bknms,bknmd->bknsd", ds, qt, precision=_HI)  # qt holds the scale
        dq = dq + jnp.einsum("bknms,bknsd->bknmd", ds, kb, precision=_HI)
        dk = dk.at[b_ix, k_ix, idx_s].add(dk_s)
        dv = dv.at[b_ix, k_ix, idx_s].add(dv_s)
        return dq, dk, dv

    zeros_kv = jnp.zeros((B, K, plan.nb, bs, D), jnp.float32)
    dq, dk, dv = lax.fori_loop(
        0, n_slots, slot, (jnp.zeros((B, K, nq, GB, D), jnp.float32), zeros_kv, zeros_kv)
    )

    def kv_out(x_BxKxNBxBSxD, like):
        x = x_BxKxNBxBSxD.transpose(0, 2, 3, 1, 4).reshape(B, plan.Tp, K, D)
        return x[:, : plan.T].astype(like.dtype)

    dq = dq.reshape(B, K, nq, G, bs, D) * (1.0 / math.sqrt(D))
    dq = _from_blocked_q(dq, plan.T).astype(q.dtype)
    return dq, kv_out(dk, k), kv_out(dv, v), None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _sparse(q, k, v, seg, idx, counts, plan):
    return _forward(q, k, v, seg, idx, counts, plan)[0]


def _sparse_fwd(q, k, v, seg, idx, counts, plan):
    out, lse = _forward(q, k, v, seg, idx, counts, plan)
    return out, (q, k, v, seg, idx, counts, out, lse)


_sparse.defvjp(_sparse_fwd, _backward)


def block_sparse_attention_xla(q, k, v, block_indices, block_counts, segment_ids, block_size):
    """Arguments are assumed checked (see ops.block_sparse_attention)."""
    B, T = q.shape[:2]
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    idx = lax.stop_gradient(block_indices.astype(jnp.int32))
    counts = lax.stop_gradient(block_counts.astype(jnp.int32))
    return _sparse(q, k, v, seg, idx, counts, Plan(T=T, bs=block_size))
