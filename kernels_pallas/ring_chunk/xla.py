"""The chunk op in blocked XLA (jnp + lax loops): forward (out, lse) and backward (dq, dk, dv).

The forward walks query blocks (`lax.scan`) and, inside each, every key block
(`lax.fori_loop`) with an online softmax (running max m, sum l, accumulator acc, float32); a
`lax.switch` on the pair's kind runs nothing for SKIP, no mask for FULL, the exact mask for
PARTIAL. The backward walks key blocks and, inside each, every query block, recomputing
p = exp(s - lse) from the caller's lse and adding ds = p * (dO v^T - delta) into dq and the
key block's dk, dv. The block table is shared by the batch (`tables.shared_kinds`), so a
switch decides for all rows at once.

Masked probabilities are set to 0 (not only their scores to NEG), so a query with no allowed
key in the chunk gets out 0 and lse NEG, and a global lse of NEG (a fill row) adds nothing.

Layouts inside: q blocks [nq, B, K, G, bq, D] (query head h = kv_head * G + g), k/v blocks
[nk, B, K, bk, D]; all arithmetic float32; outputs float32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import HI, NEG, pad_axis
from kernels_pallas.ring_chunk import tables


def _full(ref, shape, value=0.0):
    """float32 constant of `shape` varying over the same manual mesh axes as `ref` (inside
    shard_map, loop carries and switch branches must agree with the data-derived values)."""
    return lax.full_like(ref, value, jnp.float32, shape)


def _tokens_blocks(x_BxLp, b):
    """[B, Lp] -> [n, B, b]."""
    B, Lp = x_BxLp.shape
    return x_BxLp.reshape(B, Lp // b, b).transpose(1, 0, 2)


def _q_blocks(x_BxLxHxD, K, b, Lp):
    """[B, L, H, D] -> float32 [nq, B, K, G, b, D] (zero rows up to Lp)."""
    x = pad_axis(x_BxLxHxD.astype(jnp.float32), 1, Lp)
    B, _, H, D = x.shape
    return x.reshape(B, Lp // b, b, K, H // K, D).transpose(1, 0, 3, 4, 2, 5)


def _from_q_blocks(x_nxBxKxGxbxD, L):
    n, B, K, G, b, D = x_nxBxKxGxbxD.shape
    return x_nxBxKxGxbxD.transpose(1, 0, 4, 2, 3, 5).reshape(B, n * b, K * G, D)[:, :L]


def _row_blocks(x_BxLxH, K, b, Lp):
    """Per-query scalars [B, L, H] -> [nq, B, K, G, b]."""
    x = pad_axis(x_BxLxH.astype(jnp.float32), 1, Lp)
    B, _, H = x.shape
    return x.reshape(B, Lp // b, b, K, H // K).transpose(1, 0, 3, 4, 2)


def _from_row_blocks(x_nxBxKxGxb, L):
    n, B, K, G, b = x_nxBxKxGxb.shape
    return x_nxBxKxGxb.transpose(1, 0, 4, 2, 3).reshape(B, n * b, K * G)[:, :L]


def _kv_blocks(x_BxLxKxD, b, Lp):
    """[B, L, K, D] -> float32 [nk, B, K, b, D]."""
    x = pad_axis(x_BxLxKxD.astype(jnp.float32), 1, Lp)
    B, _, K, D = x.shape
    return x.reshape(B, Lp // b, b, K, D).transpose(1, 0, 3, 2, 4)


def _from_kv_blocks(x_nxBxKxbxD, L):
    n, B, K, b, D = x_nxBxKxbxD.shape
    return x_nxBxKxbxD.transpose(1, 0, 3, 2, 4).reshape(B, n * b, K, D)[:, :L]


def _pair_mask(sq_Bxbq, pq_Bxbq, sk_Bxbk, pk_Bxbk):
    """[B, 1, 1, bq, bk] exact mask of one block pair."""
    same_doc = sq_Bxbq[:, :, None] == sk_Bxbk[:, None, :]
    causal = pk_Bxbk[:, None, :] <= pq_Bxbq[:, :, None]
    return (same_doc & causal)[:, None, None]


def _blocked_ids(seg_q, pos_q, seg_k, pos_k, active, blocks: tables.ChunkBlocks):
    """Padded ids blocked [n, B, b] for both sides and the shared [nq, nk] kinds table."""
    sq, pq = tables.pad_ids(seg_q, pos_q, blocks.Lqp, tables.Q_FILL)
    sk, pk = tables.pad_ids(seg_k, pos_k, blocks.Lkp, tables.K_FILL)
    allowed, full = tables.pair_flags(tables.block_summaries(sq, pq, blocks.bq),
                                      tables.block_summaries(sk, pk, blocks.bk),
                                      blocks.bq, blocks.bk, blocks.local)
    kinds = tables.shared_kinds(allowed, full, active)
    blocked = [_tokens_blocks(x, b) for x, b in ((sq, blocks.bq), (pq, blocks.bq),
                                                  (sk, blocks.bk), (pk, blocks.bk))]
    return (*blocked, kinds)


def chunk_forward_xla(q, k, v, seg_q, pos_q, seg_k, pos_k, active, blocks: tables.ChunkBlocks,
                      out_dtype=jnp.float32):
    """out [B, Lq, H, D] in out_dtype and lse float32 [B, Lq, H] of one chunk pair."""
    K = k.shape[2]
    sq, pq, sk, pk, kinds = _blocked_ids(seg_q, pos_q, seg_k, pos_k, active, blocks)
    qb = _q_blocks(q, K, blocks.bq, blocks.Lqp) * blocks.scale
    kb_all = _kv_blocks(k, blocks.bk, blocks.Lkp)
    vb_all = _kv_blocks(v, blocks.bk, blocks.Lkp)

    def q_block(_, xs):
        q_b, sq_b, pq_b, kinds_row = xs

        def update(carry, ki, masked):
            m, l, acc = carry
            s = jnp.einsum("bkgqd,bksd->bkgqs", q_b, kb_all[ki], precision=HI)
            if masked:
                mask = _pair_mask(sq_b, pq_b, sk[ki], pk[ki])
                s = jnp.where(mask, s, NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            if masked:
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + jnp.einsum("bkgqs,bksd->bkgqd", p, vb_all[ki],
                                                      precision=HI)
            return m_new, l, acc

        def k_step(ki, carry):
            return lax.switch(kinds_row[ki], [
                lambda c: c,
                functools.partial(update, ki=ki, masked=False),
                functools.partial(update, ki=ki, masked=True),
            ], carry)

        init = (_full(q_b, q_b.shape[:-1], NEG), _full(q_b, q_b.shape[:-1]), _full(q_b, q_b.shape))
        m, l, acc = lax.fori_loop(0, blocks.nk, k_step, init)
        l = jnp.where(l == 0.0, 1.0, l)  # no allowed key: out 0, lse NEG
        return None, (acc / l[..., None], m + jnp.log(l))

    _, (out, lse) = lax.scan(q_block, None, (qb, sq, pq, kinds))
    return _from_q_blocks(out, blocks.Lq).astype(out_dtype), _from_row_blocks(lse, blocks.Lq)


def chunk_backward_xla(q, k, v, seg_q, pos_q, seg_k, pos_k, do, lse, delta, active,
                       blocks: tables.ChunkBlocks, grad_dtype=jnp.float32, out=None):
    """dq [B, Lq, H, D], dk and dv [B, Lk, K, D] in grad_dtype of one chunk pair, given the global
    lse and delta = rowsum(dO * O) [B, Lq, H] of the queries (`out`: tables.output_delta)."""
    K = k.shape[2]
    delta = tables.output_delta(do, out, delta)
    sq, pq, sk, pk, kinds = _blocked_ids(seg_q, pos_q, seg_k, pos_k, active, blocks)
    qb = _q_blocks(q, K, blocks.bq, blocks.Lqp) * blocks.scale
    dob = _q_blocks(do, K, blocks.bq, blocks.Lqp)  # fill rows get a zero cotangent
    lse_b = _row_blocks(lse, K, blocks.bq, blocks.Lqp)
    delta_b = _row_blocks(delta, K, blocks.bq, blocks.Lqp)
    kb_all = _kv_blocks(k, blocks.bk, blocks.Lkp)
    vb_all = _kv_blocks(v, blocks.bk, blocks.Lkp)
    zeros_dq_b = _full(qb, qb.shape[1:])

    def k_block(dq, xs):
        k_b, v_b, sk_b, pk_b, kinds_col = xs

        def update(carry, qi, masked):
            dk_b, dv_b = carry
            q_b, do_b = qb[qi], dob[qi]
            s = jnp.einsum("bkgqd,bksd->bkgqs", q_b, k_b, precision=HI)
            p = jnp.exp(s - lse_b[qi][..., None])
            if masked:
                p = jnp.where(_pair_mask(sq[qi], pq[qi], sk_b, pk_b), p, 0.0)
            dv_b = dv_b + jnp.einsum("bkgqs,bkgqd->bksd", p, do_b, precision=HI)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", do_b, v_b, precision=HI)
            ds = p * (dp - delta_b[qi][..., None])
            dk_b = dk_b + jnp.einsum("bkgqs,bkgqd->bksd", ds, q_b, precision=HI)  # q has scale
            return (dk_b, dv_b), jnp.einsum("bkgqs,bksd->bkgqd", ds, k_b, precision=HI)

        def q_step(qi, carry):
            dq, dkv_b = carry
            # dq stays outside the switch so the branches never copy the whole array.
            dkv_b, dq_b = lax.switch(kinds_col[qi], [
                lambda c: (c, zeros_dq_b),
                functools.partial(update, qi=qi, masked=False),
                functools.partial(update, qi=qi, masked=True),
            ], dkv_b)
            return dq.at[qi].add(dq_b), dkv_b

        zeros_kv_b = _full(k_b, k_b.shape)
        dq, dkv_b = lax.fori_loop(0, blocks.nq, q_step, (dq, (zeros_kv_b, zeros_kv_b)))
        return dq, dkv_b

    dq, (dk, dv) = lax.scan(k_block, _full(qb, qb.shape), (kb_all, vb_all, sk, pk, kinds.T))
    dq = _from_q_blocks(dq, blocks.Lq) * blocks.scale
    return tuple(x.astype(grad_dtype) for x in
                 (dq, _from_kv_blocks(dk, blocks.Lk), _from_kv_blocks(dv, blocks.Lk)))
