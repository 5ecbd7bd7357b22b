"""Blocked online-softmax attention in pure JAX/XLA, with a FlashAttention-2 style backward.

Never materialises the [T, T] score matrix: the forward walks query blocks (`lax.scan`) and,
inside each, the key blocks it can see (`lax.fori_loop`), keeping a running max, sum and
accumulator in float32; it saves the per-query log-sum-exp. The backward (`jax.custom_vjp`)
walks key blocks and, inside each, the query blocks that can see it, recomputing each block's
probabilities from q, k and the saved log-sum-exp. Memory is O(T * block).

Work skipping, two levels:
  * static: with `causal`, (query block, key block) pairs entirely above the diagonal are
    outside the loop bounds, so they cost nothing at all;
  * dynamic: `block_kinds` classifies every remaining pair from the segment ids as SKIP (no
    allowed entry for any batch row), FULL (every entry allowed: no mask arithmetic) or
    PARTIAL, and a `lax.switch` picks the branch. The table is reduced over the batch up front,
    so under a batch-sharded GSPMD jit it is one small all-reduce, not one per block.

Layout inside: q is [B, K, G, T, D] (G = H // K query heads per kv head, so query head
h = kv_head * G + g, i.e. h // G = kv_head), k/v are [B, K, T, D]; GQA's dK/dV sums over g
inside the einsum. All arithmetic is float32 whatever the input dtype (on CPU this is also
the fastest); results are cast back to the input dtypes.

Padding: T is padded up to whole blocks, separately for queries (Tq) and keys (Tk). Padded
queries copy the last real segment id (they see real keys, their outputs are sliced off and
their cotangent is zero, so they change nothing); padded keys are removed by a position mask
(j < T) — the last key block is never classified FULL when Tk > T.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas.common import NEG, HI as _HI, pad_axis

# Masked scores use NEG (finite, kernels_pallas/common.py): a row whose first visited block is
# entirely masked gets m = NEG, exp(0) = 1 junk that is wiped (alpha = exp(NEG - m_real) = 0)
# once the row meets its first allowed key; every row has one (a token always sees itself),
# so the junk never survives.
SKIP, FULL, PARTIAL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Static blocking of one call: the sequence length and its padded block grid."""

    T: int
    bq: int
    bk: int
    causal: bool

    @property
    def nq(self) -> int:
        return -(-self.T // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.T // self.bk)

    @property
    def Tq(self) -> int:
        return self.nq * self.bq

    @property
    def Tk(self) -> int:
        return self.nk * self.bk

    def k_end(self, qi):
        """One past the last key block query block `qi` can see (qi may be traced)."""
        if not self.causal:
            return self.nk
        return jnp.minimum(self.nk, ((qi + 1) * self.bq - 1) // self.bk + 1)

    def q_start(self, ki):
        """First query block that can see key block `ki` (ki may be traced)."""
        if not self.causal:
            return 0
        return (ki * self.bk) // self.bq


def make_flash_blocks(T: int, causal: bool, block_q: int, block_k: int) -> FlashBlocks:
    # A block longer than the sequence would only add padding.
    return FlashBlocks(T=T, bq=min(block_q, T), bk=min(block_k, T), causal=causal)


def _static_reachable(blocks: FlashBlocks) -> np.ndarray:
    """[nq, nk] bool: the pair is inside the loop bounds (causal: not above the diagonal)."""
    qi = np.arange(blocks.nq)[:, None]
    ki = np.arange(blocks.nk)[None, :]
    if not blocks.causal:
        return np.ones((blocks.nq, blocks.nk), dtype=bool)
    return ki * blocks.bk <= (qi + 1) * blocks.bq - 1  # first key <= last query


def _static_full(blocks: FlashBlocks) -> np.ndarray:
    """[nq, nk] bool: the pair needs no position mask (causal / key padding)."""
    qi = np.arange(blocks.nq)[:, None]
    ki = np.arange(blocks.nk)[None, :]
    full = np.ones((blocks.nq, blocks.nk), dtype=bool)
    if blocks.causal:
        full &= (ki + 1) * blocks.bk - 1 <= qi * blocks.bq  # last key <= first query
    if blocks.Tk > blocks.T:
        full &= ki != blocks.nk - 1  # holds padded keys
    return full


def block_kinds(seg_q_BxTq, seg_k_BxTk, blocks: FlashBlocks) -> jax.Array:
    """[nq, nk] int32 table of SKIP / FULL / PARTIAL from per-block segment-id summaries.

    Conservative by construction: a pair is SKIP only if, for every row, the ranges of nonzero
    ids of the two blocks do not overlap and not both blocks hold padding (id 0), which implies
    no equal ids. Ranges rather than exact sets are tight because packed documents are
    contiguous and non-decreasing; padding (0) is kept out of the ranges since it sits at the
    end of a row and would otherwise make the last block's range span every document.
    """
    B = seg_q_BxTq.shape[0]
    big = jnp.iinfo(jnp.int32).max

    def summary(seg, n, b):
        s = seg.reshape(B, n, b)
        nonzero = s != 0
        return (
            jnp.where(nonzero, s, big).min(-1),  # nonzero min (big if none)
            jnp.where(nonzero, s, -big).max(-1),  # nonzero max (-big if none)
            (~nonzero).any(-1),  # holds padding
            s.min(-1),
            s.max(-1),
        )

    qlo, qhi, q0, qmin, qmax = (x[:, :, None] for x in summary(seg_q_BxTq, blocks.nq, blocks.bq))
    klo, khi, k0, kmin, kmax = (x[:, None, :] for x in summary(seg_k_BxTk, blocks.nk, blocks.bk))
    overlap = (jnp.maximum(qlo, klo) <= jnp.minimum(qhi, khi)) | (q0 & k0)
    uniform = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
    any_allowed = overlap.any(0) & jnp.asarray(_static_reachable(blocks))
    all_allowed = uniform.all(0) & jnp.asarray(_static_full(blocks))
    return jnp.where(any_allowed, jnp.where(all_allowed, FULL, PARTIAL), SKIP).astype(jnp.int32)


def _pair_mask(seg_qb, seg_kb, qi, ki, blocks: FlashBlocks):
    """[B, 1, 1, bq, bk] bool mask of one pair (segments, causal, key padding)."""
    mask = seg_qb[:, :, None] == seg_kb[:, None, :]
    kpos = ki * blocks.bk + lax.broadcasted_iota(jnp.int32, (blocks.bq, blocks.bk), 1)
    if blocks.causal:
        qpos = qi * blocks.bq + lax.broadcasted_iota(jnp.int32, (blocks.bq, blocks.bk), 0)
        mask = mask & (kpos <= qpos)[None]
    if blocks.Tk > blocks.T:
        mask = mask & (kpos < blocks.T)[None]
    return mask[:, None, None]


def _pad_t(x, n, axis=1, mode="constant", value=0):
    return pad_axis(x, axis, n, mode, value)


def _prepare(q, k, v, seg, blocks: FlashBlocks):
    """Float32 blocked layouts: q scaled [B,K,G,Tq,D], k/v [B,K,Tk,D], seg_q [B,Tq], seg_k."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    scale = 1.0 / math.sqrt(D)
    qt = (_pad_t(q.astype(jnp.float32), blocks.Tq) * scale).reshape(B, blocks.Tq, K, G, D)
    qt = qt.transpose(0, 2, 3, 1, 4)
    kt = _pad_t(k.astype(jnp.float32), blocks.Tk).transpose(0, 2, 1, 3)
    vt = _pad_t(v.astype(jnp.float32), blocks.Tk).transpose(0, 2, 1, 3)
    seg_q = _pad_t(seg, blocks.Tq, mode="edge")
    seg_k = _pad_t(seg, blocks.Tk, mode="edge")
    return qt, kt, vt, seg_q, seg_k


def _from_blocked_q(x_BxKxGxTqxD, T):
    B, K, G, Tq, D = x_BxKxGxTqxD.shape
    return x_BxKxGxTqxD.transpose(0, 3, 1, 2, 4).reshape(B, Tq, K * G, D)[:, :T]


def _to_blocked_q(x_BxTxHxD, K, Tq):
    B, T, H, D = x_BxTxHxD.shape
    x = _pad_t(x_BxTxHxD.astype(jnp.float32), Tq).reshape(B, Tq, K, H // K, D)
    return x.transpose(0, 2, 3, 1, 4)


def _forward(q, k, v, seg, blocks: FlashBlocks):
    """Returns out [B,T,H,D] (q.dtype), lse [B,K,G,Tq] (float32) and the block kinds."""
    qt, kt, vt, seg_q, seg_k = _prepare(q, k, v, seg, blocks)
    kinds = block_kinds(seg_q, seg_k, blocks)
    B, K, G, _, D = qt.shape
    bq, bk = blocks.bq, blocks.bk

    def q_block(_, qi):
        qb = lax.dynamic_slice_in_dim(qt, qi * bq, bq, axis=3)
        sqb = lax.dynamic_slice_in_dim(seg_q, qi * bq, bq, axis=1)

        def update(carry, ki, masked):
            m, l, acc = carry
            kb = lax.dynamic_slice_in_dim(kt, ki * bk, bk, axis=2)
            vb = lax.dynamic_slice_in_dim(vt, ki * bk, bk, axis=2)
            s = jnp.einsum("bkgqd,bksd->bkgqs", qb, kb, precision=_HI)
            if masked:
                skb = lax.dynamic_slice_in_dim(seg_k, ki * bk, bk, axis=1)
                s = jnp.where(_pair_mask(sqb, skb, qi, ki, blocks), s, NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + jnp.einsum("bkgqs,bksd->bkgqd", p, vb, precision=_HI)
            return m_new, l, acc

        def k_step(ki, carry):
            return lax.switch(
                kinds[qi, ki],
                [
                    lambda c: c,
                    functools.partial(update, ki=ki, masked=False),
                    functools.partial(update, ki=ki, masked=True),
                ],
                carry,
            )

        init = (
            jnp.full((B, K, G, bq), NEG, jnp.float32),
            jnp.zeros((B, K, G, bq), jnp.float32),
            jnp.zeros((B, K, G, bq, D), jnp.float32),
        )
        m, l, acc = lax.fori_loop(0, blocks.k_end(qi), k_step, init)
        l = jnp.where(l == 0.0, 1.0, l)  # unreachable for real rows; keeps lse finite anyway
        return None, (acc / l[..., None], m + jnp.log(l))

    _, (out_blocks, lse_blocks) = lax.scan(q_block, None, jnp.arange(blocks.nq))
    # [nq, B, K, G, bq, ...] -> [B, K, G, Tq, ...]
    out = out_blocks.transpose(1, 2, 3, 0, 4, 5).reshape(B, K, G, blocks.Tq, D)
    lse = lse_blocks.transpose(1, 2, 3, 0, 4).reshape(B, K, G, blocks.Tq)
    return _from_blocked_q(out, blocks.T).astype(q.dtype), lse, kinds


def _backward(blocks: FlashBlocks, res, do):
    q, k, v, seg, out, lse, kinds = res
    qt, kt, vt, seg_q, seg_k = _prepare(q, k, v, seg, blocks)
    B, K, G, _, D = qt.shape
    bq, bk = blocks.bq, blocks.bk
    dot = _to_blocked_q(do, K, blocks.Tq)  # padded rows get a zero cotangent
    delta = (dot * _to_blocked_q(out, K, blocks.Tq)).sum(-1)  # rowsum(dO * O): [B,K,G,Tq]

    def k_block(dq, ki):
        kb = lax.dynamic_slice_in_dim(kt, ki * bk, bk, axis=2)
        vb = lax.dynamic_slice_in_dim(vt, ki * bk, bk, axis=2)
        skb = lax.dynamic_slice_in_dim(seg_k, ki * bk, bk, axis=1)

        def update(carry, qi, masked):
            dk, dv = carry
            qb = lax.dynamic_slice_in_dim(qt, qi * bq, bq, axis=3)
            dob = lax.dynamic_slice_in_dim(dot, qi * bq, bq, axis=3)
            lse_b = lax.dynamic_slice_in_dim(lse, qi * bq, bq, axis=3)
            delta_b = lax.dynamic_slice_in_dim(delta, qi * bq, bq, axis=3)
            s = jnp.einsum("bkgqd,bksd->bkgqs", qb, kb, precision=_HI)
            if masked:
                sqb = lax.dynamic_slice_in_dim(seg_q, qi * bq, bq, axis=1)
                s = jnp.where(_pair_mask(sqb, skb, qi, ki, blocks), s, NEG)
            p = jnp.exp(s - lse_b[..., None])  # masked: exp(NEG - lse) == 0 exactly
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, dob, precision=_HI)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", dob, vb, precision=_HI)
            ds = p * (dp - delta_b[..., None])
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, qb, precision=_HI)  # qb holds scale
            dq_b = jnp.einsum("bkgqs,bksd->bkgqd", ds, kb, precision=_HI)
            return (dk, dv), dq_b

        def skip(carry):
            return carry, jnp.zeros((B, K, G, bq, D), jnp.float32)

        def q_step(qi, carry):
            dq, dkv = carry
            # dq stays outside the switch so the branches never copy the full [.., Tq, D] array.
            dkv, dq_b = lax.switch(
                kinds[qi, ki],
                [
                    skip,
                    functools.partial(update, qi=qi, masked=False),
                    functools.partial(update, qi=qi, masked=True),
                ],
                dkv,
            )
            old = lax.dynamic_slice_in_dim(dq, qi * bq, bq, axis=3)
            dq = lax.dynamic_update_slice_in_dim(dq, old + dq_b, qi * bq, axis=3)
            return dq, dkv

        zeros_kv = jnp.zeros((B, K, bk, D), jnp.float32)
        dq, (dk, dv) = lax.fori_loop(blocks.q_start(ki), blocks.nq, q_step,
                                     (dq, (zeros_kv, zeros_kv)))
        return dq, (dk, dv)

    dq0 = jnp.zeros((B, K, G, blocks.Tq, D), jnp.float32)
    dq, (dk_blocks, dv_blocks) = lax.scan(k_block, dq0, jnp.arange(blocks.nk))

    def kv_out(x_nkxBxKxbkxD, like):
        x = x_nkxBxKxbkxD.transpose(1, 0, 3, 2, 4).reshape(B, blocks.Tk, K, D)
        return x[:, : blocks.T].astype(like.dtype)

    dq = (_from_blocked_q(dq, blocks.T) * (1.0 / math.sqrt(D))).astype(q.dtype)
    return dq, kv_out(dk_blocks, k), kv_out(dv_blocks, v), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, blocks):
    return _forward(q, k, v, seg, blocks)[0]


def _flash_fwd(q, k, v, seg, blocks):
    out, lse, kinds = _forward(q, k, v, seg, blocks)
    return out, (q, k, v, seg, out, lse, kinds)


_flash.defvjp(_flash_fwd, _backward)


def flash_attention_xla(q, k, v, segment_ids, causal: bool, block_q: int, block_k: int):
    """Blocked attention; arguments are assumed checked (see ops.flash_attention)."""
    B, T = q.shape[:2]
    if segment_ids is None:
        seg = jnp.ones((B, T), jnp.int32)
    else:
        seg = segment_ids.astype(jnp.int32)
    return _flash(q, k, v, seg, make_flash_blocks(T, causal, block_q, block_k))
