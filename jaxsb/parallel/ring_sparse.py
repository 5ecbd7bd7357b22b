"""Block-sparse (MoBA-routed) attention under ring sequence parallelism.

`ring_sparse_attention` runs inside `jax.shard_map` over a 1-D axis, with the groups of
`jaxsb.parallel.ring` and the zigzag layout of `jaxsb.plan.layout`: a group's stream (its
documents, each padded to a multiple of `block_size` with segment id 0) padded to 2·d·c
tokens is cut into 2·d chunks of c tokens, rank r holding chunks r and 2d−1−r (T = 2c tokens
per device, c a multiple of `block_size`). Every block of `block_size` tokens on a device is
then one block of the stream, with a global (stream) block index known from (rank, degree).

It computes exactly what `jaxsb.models.attention.sparse_attend` computes on the same documents
laid out in one row (each document starting on a block boundary):

1. Pooling. Each block holds one document's tokens followed by padding, or padding only, so
   route()'s pooling reduces to: the block's document is the segment id of its first token,
   pooled keys / queries are the means over that document's e tokens of the block (queries
   also over the G query heads of a kv head), via the same within-block prefix sums.
2. Circulation. The pooled keys, the blocks' segment ids and global indices go around each
   ring (`ring_loop.ring_loop`, one ppermute per round, idle rings skip), so every device holds
   its group's pooled stream in global block order.
3. Routing, as route(): score = pooled q · pooled k / sqrt(D); eligible = same document and
   block index <= the query block's (causal at block level); diagonal first, then top-k by
   score, ties to the lower GLOBAL index, so the selection equals the single-row one;
   count = min(max(budget, 1), eligible); coverage = softmax mass of the selected blocks.
   Padding query blocks (first token id 0) take their diagonal only.
4. Attention. The kv shards go around the ring as in ring.py. The selected global blocks of
   every (row, kv head, query block) are sorted once by the rank that owns them; in the round
   in which rank o's shard visits, a device loops j = 0 .. (most blocks any of its query blocks
   selected from rank o) - 1 and, in iteration j, every query block attends the j-th block it
   selected from that shard (gathered), with the exact token mask (same segment id,
   pos_k <= pos_q). A round with nothing selected from the visiting shard (another document,
   a later chunk, a ring that is done) runs zero iterations: the work follows the selection,
   not the dense causal mask. Online softmax (float32) across iterations and rounds.
   Backward (custom_vjp): the same trip and iterations, FlashAttention-2 style from the saved
   log-sum-exp; dq accumulates locally, the visiting shard's dk|dv accumulator is
   scatter-added (duplicate block choices add up) and travels back to its owner.
   That is implementation="xla" (this module's code, any backend). With "pallas" each round
   is instead one call of the ring's chunk op (kernels_pallas/ring_chunk/) on its
   Pallas kernels, blocks = the routing blocks, with the round's block selection
   `select[b, k, n, j]` = "query block n chose local block j of the visiting shard": the
   kernels turn every unselected pair into SKIP per kv head and never load those blocks;
   rounds merge their (out, lse) with merge_chunks and the backward runs chunk_backward from
   the global lse, as ring.py does. "auto" (the executor's choice, as sparse_attend's) is
   Pallas on GPU and XLA elsewhere. The routing is the same code for both.

Assumptions (the layout guarantees them): positions increase along a document (the causal
mask uses pos_k <= pos_q), real segment ids are unique per document within a group, and a
document starts on a block boundary of the stream. Padding outputs are finite but arbitrary;
their gradients are zero when their output cotangents are.

Statistics: `mean_selected_blocks` and `mean_coverage` are means over this device's
(row, kv head, query block) weighted by the query block's real (id > 0) tokens — the
token-weighted counterparts of sparse_attend's statistics (which are unweighted over blocks,
padding blocks included, for the counts, and per-row for the coverage). Weighted by the
device's real tokens and summed over devices they give the whole batch's token-weighted
means. A device without real tokens returns 0 for both.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsb.parallel.ring_loop import RingConfig, ring_config, ring_loop, vma_full
from kernels_pallas.common import HI, NEG
from kernels_pallas.ring_chunk.ops import (backward_with_blocks, forward_with_blocks,
                                           merge_chunks)
from kernels_pallas.ring_chunk.tables import make_chunk_blocks

_NO_OWNER = -1  # sorted slots past a query block's count


# ----------------------------------------------------------------------------- stream indices


def _rank_degree(cfg: RingConfig):
    """This device's (rank within its ring, ring degree), traced int32 scalars."""
    ranks = np.concatenate([np.arange(d, dtype=np.int32) for _, d in cfg.groups])
    i = lax.axis_index(cfg.axis_name)
    return jnp.asarray(ranks)[i], jnp.asarray(cfg.degrees())[i]


def _global_blocks(rank, degree, cb: int):
    """[2cb] int32: stream block index of each local block (chunks rank and 2d-1-rank)."""
    i = jnp.arange(2 * cb, dtype=jnp.int32)
    return jnp.where(i < cb, rank * cb + i, (2 * degree - 1 - rank) * cb + i - cb)


def _owner(g, degree, cb: int):
    """(owning rank, local block index) of stream block g."""
    chunk = g // cb
    late = chunk >= degree
    return jnp.where(late, 2 * degree - 1 - chunk, chunk), g % cb + jnp.where(late, cb, 0)


# ----------------------------------------------------------------------------- routing


def _pool(q, k, seg, bs: int):
    """Per local block: pooled query [B,nb,K,D], pooled key [B,nb,K,D], the document (segment
    id of the first token) [B,nb] and real-token weight [B,nb], as router.block_scores pools."""
    B, T, H, D = q.shape
    K = k.shape[2]
    nb = T // bs
    qg = q.astype(jnp.float32).reshape(B, T, K, H // K, D).mean(3)

    def prefix(x):  # the same within-block prefix sums as router.block_scores
        xb = x.reshape(B, nb, bs, K, D)
        zero = jnp.zeros((B, nb, 1, K, D), jnp.float32)
        return jnp.concatenate([zero, jnp.cumsum(xb, axis=2)], axis=2)

    segb = seg.reshape(B, nb, bs)
    doc = segb[:, :, 0]
    e = (segb == doc[..., None]).sum(-1)  # >= 1: the document's tokens lead the block
    bi, ni = jnp.arange(B)[:, None], jnp.arange(nb)[None, :]
    qbar = prefix(qg)[bi, ni, e] / e[..., None, None]
    kbar = prefix(k.astype(jnp.float32))[bi, ni, e] / e[..., None, None]
    weights = (segb > 0).sum(-1).astype(jnp.float32)
    return qbar, kbar, doc, weights


def _route(q, k, seg, budgets, cfg: RingConfig, max_blocks: int, floor=None, curve_bins=None):
    """(sorted owners, sorted local indices [B,K,nb,M], stats).

    Slots hold the selected blocks of each (row, kv head, query block) grouped by owning rank
    (ascending), in selection order within a rank; slots past the count have owner -1.
    `floor` = (k_base, p): route()'s runtime floor, the document curves averaged over the
    document's blocks on every rank of the ring (their head-summed curves go around it)."""
    q, k = lax.stop_gradient(q), lax.stop_gradient(k)
    B, T, H, D = q.shape
    K, bs = k.shape[2], cfg.block
    cb = T // (2 * bs)
    nbg = 2 * cfg.max_degree * cb  # stream blocks of the largest ring
    M = max_blocks
    rank, degree = _rank_degree(cfg)
    qbar, kbar, doc, weights = _pool(q, k, seg, bs)
    gq = _global_blocks(rank, degree, cb)

    def gather(active, _local, ride, _acc, carry):
        kb_r, doc_r, g_r = ride
        kg, dg = carry
        idx = jnp.where(active, g_r, nbg)  # out of range: dropped
        return None, (kg.at[:, idx].set(kb_r, mode="drop"), dg.at[:, idx].set(doc_r, mode="drop"))

    # _full / full_like: carries that vary over the axis like the data (shard_map check_vma)
    carry = (vma_full(kbar, (B, nbg, K, D)), lax.full_like(doc, -1, jnp.int32, (B, nbg)))
    _, (kg, dg) = ring_loop(cfg, gather, (kbar, doc, gq), None, carry)

    scale = 1.0 / math.sqrt(D)
    s = jnp.einsum("bnkd,bjkd->bknj", qbar, kg, precision=HI) * scale  # [B,K,nb,nbg]
    s_diag = jnp.einsum("bnkd,bnkd->bkn", qbar, kbar, precision=HI) * scale
    j = jnp.arange(nbg)[None, None, None, :]
    n = gq[None, None, :, None]
    diag = j == n
    same_doc = (dg[:, None, None, :] == doc[:, None, :, None]) & (doc[:, None, :, None] > 0)
    eligible = diag | (same_doc & (j < n))
    scores = jnp.where(eligible, jnp.where(diag, s_diag[..., None], s), -jnp.inf)
    _, idx = lax.top_k(jnp.where(diag, jnp.inf, scores), M)  # ties: lower global index
    budget = jnp.clip(jnp.asarray(budgets, jnp.int32)[:, ::bs][:, None, :], 1, M)
    floor_info = None
    if floor is not None:
        from jaxsb.models.router import (Floor, apply_floor, block_curves, document_mean, document_tokens,
                                         length_bin_sums)

        c_local = block_curves(scores, M).sum(1)  # [B, nb, M] summed over kv heads

        def gather_curves(active, _local, ride, _acc, carry):
            c_r, w_r, g_r = ride
            idx = jnp.where(active, g_r, nbg)
            return None, (carry[0].at[:, idx].set(c_r, mode="drop"), carry[1].at[:, idx].set(w_r, mode="drop"))

        _, (cg, wg) = ring_loop(cfg, gather_curves, (c_local, weights, gq), None,
                                (vma_full(c_local, (B, nbg, M)), vma_full(weights, (B, nbg))))
        doc_curve = document_mean(cg, doc, dg, c_local, jnp.float32(K))
        planned = jnp.broadcast_to(budget[:, 0, :], (B, T // bs))
        final, overridden, c_final, drop = apply_floor(doc_curve, planned, floor[0], floor[1], doc)
        bins = (None, None)
        if curve_bins:
            bins = length_bin_sums(doc_curve, document_tokens(doc, dg, wg), (doc > 0) & (weights > 0), curve_bins)
        floor_info = Floor(planned, final, overridden, weights, c_final, drop, *bins)
        budget = final[:, None, :]
    counts = jnp.broadcast_to(jnp.minimum(budget, eligible.sum(-1)), (B, K, T // bs))
    slot_ok = jnp.arange(M) < counts[..., None]

    p = jax.nn.softmax(scores, axis=-1)
    kept = jnp.clip((jnp.take_along_axis(p, idx, axis=-1) * slot_ok).sum(-1), 0.0, 1.0)
    w = weights[:, None, :]
    total = K * weights.sum()
    denom = jnp.maximum(total, 1.0)
    stats = {"sparse_blocks": jnp.where(total > 0, (counts * w).sum() / denom, 0.0),
             "sparse_coverage": jnp.where(total > 0, (kept * w).sum() / denom, 0.0),
             "attn_block_pairs": jnp.sum(counts.astype(jnp.float32))}
    if floor_info is not None:
        from jaxsb.models.attention import floor_stats

        stats.update(floor_stats(floor_info))

    owner, local = _owner(idx, degree, cb)
    last = cfg.max_degree * M  # slots past the count sort after every owner's
    order = jnp.argsort(jnp.where(slot_ok, owner * M, last) + jnp.arange(M), axis=-1)
    s_owner = jnp.where(jnp.take_along_axis(slot_ok, order, -1),
                        jnp.take_along_axis(owner, order, -1), _NO_OWNER)
    s_local = jnp.take_along_axis(local, order, -1)
    return s_owner.astype(jnp.int32), s_local.astype(jnp.int32), stats


def _slots(s_owner, origin, active):
    """(first slot, number of slots) [B,K,nb] of the blocks selected from rank `origin`."""
    mine = s_owner == origin
    start = ((s_owner >= 0) & (s_owner < origin)).sum(-1)
    return start, jnp.where(active, mine.sum(-1), 0)


# ----------------------------------------------------------------------------- attention


def _q_blocks(x, K, bs):
    """[B, T, H, D] -> float32 [B, K, nb, G, bs, D]."""
    B, T, H, D = x.shape
    return x.astype(jnp.float32).reshape(B, T // bs, bs, K, H // K, D).transpose(0, 3, 1, 4, 2, 5)


def _from_q_blocks(x):
    B, K, nb, G, bs, D = x.shape
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(B, nb * bs, K * G, D)


def _kv_blocks(kv, bs):
    """Packed [B, T, 2K, D] -> float32 k and v blocks [B, K, nb, bs, D]."""
    B, T, K2, D = kv.shape
    x = kv.astype(jnp.float32).reshape(B, T // bs, bs, K2, D).transpose(0, 3, 1, 2, 4)
    return x[:, : K2 // 2], x[:, K2 // 2 :]


def _from_kv_blocks(x):
    B, K, nb, bs, D = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(B, nb * bs, K, D)


class _Visit:
    """One visiting kv shard, as blocks, and per iteration j the blocks each query block reads."""

    def __init__(self, ride, s_owner, s_local, sq, pq, active, bs):
        kv, sp, origin = ride
        self.kb, self.vb = _kv_blocks(kv, bs)
        B, nb = sq.shape[:2]
        self.sk, self.pk = sp[..., 0].reshape(B, nb, bs), sp[..., 1].reshape(B, nb, bs)
        self.start, self.count = _slots(s_owner, origin[0], active)
        self.s_local, self.sq, self.pq = s_local, sq, pq
        self.bi = jnp.arange(B)[:, None, None]
        self.ki = jnp.arange(self.kb.shape[1])[None, :, None]

    def iterations(self):
        return self.count.max()

    def blocks(self, j):
        """(local block [B,K,nb], k, v blocks [B,K,nb,bs,D], mask [B,K,nb,1,bs,bs])."""
        M = self.s_local.shape[-1]
        slot = jnp.minimum(self.start + j, M - 1)
        li = jnp.take_along_axis(self.s_local, slot[..., None], -1)[..., 0]
        sk, pk = self.sk[self.bi, li], self.pk[self.bi, li]  # [B,K,nb,bs]
        mask = (self.sq[:, None, :, :, None] == sk[..., None, :]) & (
            pk[..., None, :] <= self.pq[:, None, :, :, None])
        mask &= (j < self.count)[..., None, None]
        return li, self.kb[self.bi, self.ki, li], self.vb[self.bi, self.ki, li], mask[:, :, :, None]


def _ride(k, v, seg, pos, cfg: RingConfig):
    """What travels: k|v packed, (seg, pos) packed and the owner's ring rank."""
    rank, _ = _rank_degree(cfg)
    return jnp.concatenate([k, v], axis=2), jnp.stack([seg, pos], axis=-1), rank.reshape(1)


def _prepare(q, k, v, seg, pos, cfg: RingConfig):
    B, T, H, D = q.shape
    bs = cfg.block
    ride = _ride(k, v, seg, pos, cfg)
    qb = _q_blocks(q, k.shape[2], bs) * (1.0 / math.sqrt(D))
    return qb, seg.reshape(B, T // bs, bs), pos.reshape(B, T // bs, bs), ride


def _forward_xla(q, k, v, seg, pos, s_owner, s_local, cfg: RingConfig):
    """(out in q's dtype, lse [B,K,nb,G,bs]) of the whole ring, XLA rounds."""
    qb, sq, pq, ride = _prepare(q, k, v, seg, pos, cfg)

    def step(active, _local, ride, _acc, state):
        visit = _Visit(ride, s_owner, s_local, sq, pq, active, cfg.block)

        def body(j, state):
            m, l, acc = state
            _, kb, vb, mask = visit.blocks(j)
            s = jnp.where(mask, jnp.einsum("bkngqd,bknsd->bkngqs", qb, kb, precision=HI), NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + jnp.einsum("bkngqs,bknsd->bkngqd", p, vb, precision=HI)
            return m_new, l, acc

        return None, lax.fori_loop(0, visit.iterations(), body, state)

    state = (vma_full(qb, qb.shape[:-1], NEG), vma_full(qb, qb.shape[:-1]), vma_full(qb, qb.shape))
    _, (m, l, acc) = ring_loop(cfg, step, ride, None, state)
    l = jnp.where(l == 0.0, 1.0, l)  # every query meets itself on its diagonal: not expected
    out = _from_q_blocks(acc / l[..., None]).astype(q.dtype)
    return out, m + jnp.log(l)


def _backward_xla(cfg: RingConfig, res, do):
    """(dq, dk, dv) of the whole ring, XLA rounds."""
    q, k, v, seg, pos, s_owner, s_local, out, lse = res
    K, bs = k.shape[2], cfg.block
    qb, sq, pq, ride = _prepare(q, k, v, seg, pos, cfg)
    dob = _q_blocks(do, K, bs)
    delta = (dob * _q_blocks(out, K, bs)).sum(-1)  # rowsum(dO * O)

    def step(active, _local, ride, dkv, dq):
        visit = _Visit(ride, s_owner, s_local, sq, pq, active, bs)
        bi, ki = visit.bi, visit.ki

        def body(j, carry):
            dq, dk, dv = carry
            li, kb, vb, mask = visit.blocks(j)
            s = jnp.einsum("bkngqd,bknsd->bkngqs", qb, kb, precision=HI)
            p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
            dv = dv.at[bi, ki, li].add(jnp.einsum("bkngqs,bkngqd->bknsd", p, dob, precision=HI))
            dp = jnp.einsum("bkngqd,bknsd->bkngqs", dob, vb, precision=HI)
            ds = p * (dp - delta[..., None])
            dq = dq + jnp.einsum("bkngqs,bknsd->bkngqd", ds, kb, precision=HI)
            dk = dk.at[bi, ki, li].add(jnp.einsum("bkngqs,bkngqd->bknsd", ds, qb, precision=HI))
            return dq, dk, dv

        dq, dk, dv = lax.fori_loop(0, visit.iterations(), body, (dq, *dkv))
        return (dk, dv), dq

    B, T = seg.shape
    zeros_kv = vma_full(qb, (B, K, T // bs, bs, k.shape[3]))
    (dk, dv), dq = ring_loop(cfg, step, ride, (zeros_kv, zeros_kv), vma_full(qb, qb.shape))
    dq = (_from_q_blocks(dq) * (1.0 / math.sqrt(q.shape[3]))).astype(q.dtype)
    return dq, _from_kv_blocks(dk).astype(k.dtype), _from_kv_blocks(dv).astype(v.dtype)


# ----------------------------------------------------------------------------- Pallas rounds


def _selection(s_owner, s_local, origin, active, nb: int):
    """bool [B, K, nb, nb]: local query block n reads local block j of the visiting shard
    (ring rank `origin`'s) in this round; all False when the round is idle."""
    B, K, nq, _ = s_local.shape
    col = jnp.where((s_owner == origin) & active, s_local, nb)  # other owners: a spare column
    sel = lax.full_like(s_owner, False, jnp.bool_, (B, K, nq, nb + 1))
    bi, ki, ni = (jnp.arange(n).reshape(shape) for n, shape in
                  ((B, (B, 1, 1, 1)), (K, (1, K, 1, 1)), (nq, (1, 1, nq, 1))))
    return sel.at[bi, ki, ni, col].set(True)[..., :nb]


def _round(cfg: RingConfig, q, local: bool, active, ride, s_owner, s_local):
    """One round's chunk plan (blocks = the routing blocks), the visiting (k, v, seg, pos)
    and the round's block selection."""
    kv, sp, origin = ride
    K = kv.shape[2] // 2
    T, D = q.shape[1], q.shape[3]
    plan = make_chunk_blocks(T, T, D, cfg.block, cfg.block, local, pallas=True,
                             interpret=cfg.interpret, mosaic=cfg.implementation == "mosaic")
    sel = _selection(s_owner, s_local, origin[0], active, T // cfg.block)
    return plan, (kv[:, :, :K], kv[:, :, K:], sp[..., 0], sp[..., 1]), sel


def _forward_pallas(q, k, v, seg, pos, s_owner, s_local, cfg: RingConfig):
    """(out in q's dtype, lse [B,T,H]): each round one chunk call whose selection turns every
    unselected (query block, key block) pair into SKIP; rounds merge as in ring.py."""

    def step(active, local, ride, _, state):
        plan, (k_r, v_r, seg_r, pos_r), sel = _round(cfg, q, local, active, ride, s_owner,
                                                      s_local)
        out_r, lse_r = forward_with_blocks(cfg.implementation, plan, q, k_r, v_r, seg, pos,
                                           seg_r, pos_r, active, sel)
        return None, merge_chunks(*state, out_r, lse_r)

    state = (vma_full(q, q.shape), vma_full(q, q.shape[:3], NEG))
    _, (out, lse) = ring_loop(cfg, step, _ride(k, v, seg, pos, cfg), None, state)
    return out.astype(q.dtype), lse


def _backward_pallas(cfg: RingConfig, res, do):
    """(dq, dk, dv): the same rounds and selections, chunk_backward from the global lse."""
    q, k, v, seg, pos, s_owner, s_local, out, lse = res
    B, T, K, D = k.shape
    delta = (do.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)  # rowsum(dO * O)

    def step(active, local, ride, dkv, dq):
        plan, (k_r, v_r, seg_r, pos_r), sel = _round(cfg, q, local, active, ride, s_owner,
                                                      s_local)
        dq_r, dk_r, dv_r = backward_with_blocks(cfg.implementation, plan, q, k_r, v_r, seg,
                                                pos, seg_r, pos_r, do, lse, delta, active,
                                                sel)
        return dkv + jnp.concatenate([dk_r, dv_r], axis=2), dq + dq_r

    dkv, dq = ring_loop(cfg, step, _ride(k, v, seg, pos, cfg), vma_full(k, (B, T, 2 * K, D)),
                        vma_full(q, q.shape))  # dkv is home
    return dq.astype(q.dtype), dkv[:, :, :K].astype(k.dtype), dkv[:, :, K:].astype(v.dtype)


# ----------------------------------------------------------------------------- custom_vjp

# "mosaic" is what "pallas" resolves to on TPU: the same rounds on the Mosaic chunk kernels
_FORWARD = {"xla": _forward_xla, "pallas": _forward_pallas, "mosaic": _forward_pallas}
_BACKWARD = {"xla": _backward_xla, "pallas": _backward_pallas, "mosaic": _backward_pallas}


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _sparse_ring(q, k, v, seg, pos, s_owner, s_local, cfg):
    return _FORWARD[cfg.implementation](q, k, v, seg, pos, s_owner, s_local, cfg)[0]


def _sparse_ring_fwd(q, k, v, seg, pos, s_owner, s_local, cfg):
    out, lse = _FORWARD[cfg.implementation](q, k, v, seg, pos, s_owner, s_local, cfg)
    return out, (q, k, v, seg, pos, s_owner, s_local, out, lse)


def _sparse_ring_bwd(cfg: RingConfig, res, do):
    return (*_BACKWARD[cfg.implementation](cfg, res, do), None, None, None, None)


_sparse_ring.defvjp(_sparse_ring_fwd, _sparse_ring_bwd)


# ----------------------------------------------------------------------------- public


def _check(q, k, v, seg, pos, budgets, axis_name, groups, block_size, max_blocks,
           implementation="xla", interpret=None):
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    B, T = seg.shape
    if T % (2 * block_size):
        raise ValueError(f"tokens per device T={T} must be a multiple of 2*block_size="
                         f"{2 * block_size} (two zigzag chunks of whole blocks)")
    # the Pallas chunk's blocks are the routing blocks (compiled: a power of two >= 16)
    cfg = ring_config(q, k, v, seg, pos, axis_name, groups, block_size, implementation,
                      interpret)
    if tuple(jnp.shape(budgets)) != (B, T) or not jnp.issubdtype(jnp.asarray(budgets).dtype, jnp.integer):
        raise ValueError(f"budgets_BxT must be integer (B, T)={(B, T)}, got shape "
                         f"{tuple(jnp.shape(budgets))} dtype {jnp.asarray(budgets).dtype}")
    cfg = dataclasses.replace(cfg, block=block_size)
    stream_blocks = 2 * cfg.max_degree * (T // (2 * block_size))
    if max_blocks is None:
        max_blocks = stream_blocks
    bad = isinstance(max_blocks, bool) or not isinstance(max_blocks, int)
    if bad or not 1 <= max_blocks <= stream_blocks:
        raise ValueError(f"max_blocks={max_blocks!r} must be an int in [1, {stream_blocks}] "
                         f"(the largest ring's stream blocks)")
    return cfg, max_blocks


def ring_sparse_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxKxD: jax.Array,
    v_BxTxKxD: jax.Array,
    seg_BxT: jax.Array,
    pos_BxT: jax.Array,
    budgets_BxT: jax.Array,
    *,
    axis_name: str,
    groups: tuple[tuple[int, int], ...],
    block_size: int,
    max_blocks: int | None = None,
    implementation: str = "auto",
    interpret: bool | None = None,
    floor: tuple[int, float] | None = None,
    curve_bins: int | None = None,
):
    """Routed block-sparse causal document attention over ring groups (inside shard_map).

    q [B,T,H,D], k/v [B,T,K,D], seg/pos [B,T] int, budgets [B,T] int (a query block takes the
    budget of its first token): this device's T = 2c tokens of its ring's zigzag stream (see
    the module docstring; T % (2*block_size) == 0). `groups` as in ring_attention.
    `max_blocks` (static) caps the blocks per query block; default the largest ring's stream
    blocks, which never binds (route()'s default); `floor` = (k_base, p): route()'s runtime
    floor. Returns (out [B,T,H,D] in q's dtype, stats: sparse_attend's names, float32 scalars
    weighted by real tokens). Differentiable in q, k, v through the attention (the selection is not), ring
    backward; differentiate outside the shard_map when check_vma=False (see ring_attention).

    `implementation`: "xla" (this module's gather loops), "pallas" (each round one call of the
    chunk op's Pallas kernels with the round's block selection; compiled, block_size must be a
    power of two >= 16) or "auto" (Pallas on GPU, XLA elsewhere, as block_sparse_attention
    picks); `interpret` (Pallas only): None = the interpreter iff the backend is CPU, which
    needs shard_map(check_vma=False), as for ring_attention.
    """
    cfg, max_blocks = _check(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, seg_BxT, pos_BxT, budgets_BxT,
                             axis_name, groups, block_size, max_blocks, implementation, interpret)
    seg = seg_BxT.astype(jnp.int32)
    pos = pos_BxT.astype(jnp.int32)
    s_owner, s_local, stats = _route(q_BxTxHxD, k_BxTxKxD, seg, budgets_BxT, cfg, max_blocks, floor, curve_bins)
    out = _sparse_ring(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, seg, pos, s_owner, s_local, cfg)
    return out, stats


def ring_sparse_iterations(q_BxTxHxD, k_BxTxKxD, seg_BxT, budgets_BxT, *, axis_name: str, groups,
                           block_size: int, max_blocks: int | None = None, floor=None) -> jax.Array:
    """int32 [max_degree]: the attention loop's iterations per round on this device (each one
    (query block, key block) pair per query block), for tests and planning. Call in shard_map."""
    B, T = seg_BxT.shape
    v = k_BxTxKxD
    pos = jnp.zeros_like(seg_BxT)
    cfg, max_blocks = _check(q_BxTxHxD, k_BxTxKxD, v, seg_BxT, pos, budgets_BxT, axis_name,
                             groups, block_size, max_blocks)
    s_owner, _, _ = _route(q_BxTxHxD, k_BxTxKxD, seg_BxT.astype(jnp.int32), budgets_BxT, cfg, max_blocks, floor)
    rank, degree = _rank_degree(cfg)
    r = jnp.arange(cfg.max_degree, dtype=jnp.int32)
    origins = (rank - r) % degree
    counts = jax.vmap(lambda o, a: _slots(s_owner, o, a)[1].max())(origins, r < degree)
    return counts.astype(jnp.int32)
