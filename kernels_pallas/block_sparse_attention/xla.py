"""Block-sparse attention in pure JAX/XLA whose work follows each query block's own count.

Each query block n of each (batch row b, kv head k) attends to the key blocks
`block_indices[b, k, n, :block_counts[b, k, n]]`.

Host metadata first (`block_lists`, plain JAX on small int arrays): per query block, the valid
entries (slot below the count, index in [0, n]: a later block selects nothing under the causal
mask) with repeats removed, compacted and sorted ascending, and their number `cnt`. Then the
query blocks are sorted by decreasing `cnt` (per row and kv head) and cut into groups of
`SparseBlocks.gq` consecutive blocks. Group g runs `trip[g]` = its largest count (its first
block's) slot steps, so the work is sum over groups of trip[g] x gq query blocks, which follows
each query block's own count up to the spread inside one group, instead of max(counts) x nq.

One slot step of one group: gather the gq key/value blocks it needs ([B, K, gq, bs, D], one
per query block), scores as one batched matmul [B, K, gq, G*bs, bs], mask (slot valid, causal,
same segment, key padding), float32 online softmax. The group size is chosen so a step's
score tile stays around `SCORE_TILE_BYTES` (cache-resident): on CPU a batched matmul over all
nq query blocks at once spills the caches and runs ~3x slower per FLOP than the same work in
groups. Steps whose every pair is strictly below the diagonal inside one document
(`Meta.full`) run without the mask (`lax.cond`). The log-sum-exp is saved (in sorted order,
with the metadata).

The backward (`jax.custom_vjp`, FlashAttention-2 formulas) walks the same groups and slots,
recomputes p = exp(s - lse) with the scores transposed (every matmul a plain or
right-transposed product, see _backward), accumulates a group's dq in the loop carry (query
blocks are never scattered) and scatter-adds each step's dk/dv blocks into the selected key
blocks.

Layout inside: q is [B, K, nq, G*bs, D] (G = H // K query heads of kv head k, the G heads and
the block's rows merged into one matmul dimension, so GQA's dk/dv sums over heads inside the
matmul), k/v are [B, K, nb, bs, D]. All arithmetic is float32; results are cast back.

Masked scores are -inf and the running max starts at the finite NEG, so masked entries give
exp(-inf) = 0 exactly, and a row that sees nothing keeps l = 0 and outputs 0 (like the
reference). Slots past a block's own count (its group runs longer) hold the filler index nb,
an all-zero block appended to k and v (no selected block is read there); the mask removes
them, and their (zero) dk/dv lands in the appended block, which is dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import NEG, HI as _HI, pad_axis

# Target size of one step's float32 score tile [B, K, gq, G*bs, bs]; see the module doc.
SCORE_TILE_BYTES = 2 << 20
_NO_SEG = jnp.iinfo(jnp.int32).min  # "not one segment" marker in _metadata


@dataclasses.dataclass(frozen=True)
class SparseBlocks:
    """Static blocking of one call: T, the block size, query blocks per loop step."""

    T: int
    bs: int
    gq: int

    @property
    def nb(self) -> int:
        return -(-self.T // self.bs)

    @property
    def Tp(self) -> int:
        return self.nb * self.bs

    @property
    def ngroups(self) -> int:
        return -(-self.nb // self.gq)

    @property
    def nqp(self) -> int:
        """Query blocks padded to whole groups (the extra ones have count 0)."""
        return self.ngroups * self.gq


def make_sparse_blocks(B: int, T: int, H: int, K: int, block_size: int,
                       gq: int | None = None) -> SparseBlocks:
    """gq = query blocks per step: as many as keep the step's scores near SCORE_TILE_BYTES."""
    nb = -(-T // block_size)
    if gq is None:
        per_block = B * H * block_size * block_size * 4
        gq = SCORE_TILE_BYTES // per_block
    return SparseBlocks(T=int(T), bs=int(block_size), gq=int(max(1, min(gq, nb))))


def _pad_t(x, n, axis=1, mode="constant", value=0):
    return pad_axis(x, axis, n, mode, value)


def block_lists(block_indices, block_counts, nb: int):
    """Clean lists: ([B,K,nq,M] int32 valid key blocks ascending then `nb` filler, [B,K,nq]
    int32 count). Valid: slot below the count, index in [0, n] for query block n; repeats
    count once."""
    M = block_indices.shape[-1]
    idx = block_indices.astype(jnp.int32)
    counts = jnp.clip(block_counts.astype(jnp.int32), 0, M)
    valid = (jnp.arange(M) < counts[..., None]) & (idx >= 0) & (idx <= jnp.arange(nb)[:, None])
    lst = jnp.sort(jnp.where(valid, idx, nb), axis=-1)
    repeat = jnp.concatenate(
        [jnp.zeros_like(lst[..., :1], bool), lst[..., 1:] == lst[..., :-1]], axis=-1
    )
    lst = jnp.sort(jnp.where(repeat, nb, lst), axis=-1)
    return lst, (lst < nb).sum(-1, dtype=jnp.int32)


class Meta(NamedTuple):
    """Per-call metadata in sorted query-block order (see the module doc)."""

    perm: jax.Array  # [B, K, nqp]: sorted position -> query block (>= nb: a filler block)
    lst: jax.Array  # [B, K, nqp, M]: its clean list, filler nb past the count
    cnt: jax.Array  # [B, K, nqp]: its count (non-increasing along the last axis)
    trip: jax.Array  # [ngroups]: slot steps of each group (its largest count)
    full: jax.Array  # [ngroups, M] bool: the step needs no mask (see _metadata)


def _metadata(idx, counts, seg_BxT, blocks: SparseBlocks) -> Meta:
    """Lists sorted by count, groups' trip counts, and which steps need no mask: every pair
    of the step is below its count, strictly below the diagonal (so causal holds and the
    key block has no padding) and both blocks hold one and the same segment id."""
    nb, bs = blocks.nb, blocks.bs
    lst, cnt = block_lists(idx, counts, nb)
    extra = blocks.nqp - nb
    if extra:
        lst = _pad_t(lst, blocks.nqp, axis=2, value=nb)
        cnt = _pad_t(cnt, blocks.nqp, axis=2, value=0)
    perm = jnp.argsort(-cnt, axis=-1, stable=True).astype(jnp.int32)
    cnt = jnp.take_along_axis(cnt, perm, axis=-1)
    lst = jnp.take_along_axis(lst, perm[..., None], axis=-2)
    trip = cnt[:, :, :: blocks.gq].max(axis=(0, 1))  # a group's first block has its largest count

    seg_b = _pad_t(seg_BxT, blocks.Tp, mode="edge").reshape(-1, nb, bs)
    first = seg_b[:, :, 0]
    one = (seg_b == first[..., None]).all(-1) & (first != _NO_SEG)  # [B, nb]
    first = jnp.where(one, first, _NO_SEG)  # _NO_SEG: never equal to a one-segment block
    first = _pad_t(first, nb + 1, axis=1, value=_NO_SEG)[:, None, :]  # [B, 1, nb + 1]
    q_first = jnp.take_along_axis(first, jnp.minimum(perm, nb), axis=-1)  # [B, K, nqp]
    k_first = jnp.take_along_axis(first, lst.reshape(lst.shape[:2] + (-1,)), axis=-1)
    pair = (lst < perm[..., None]) & (k_first.reshape(lst.shape) == q_first[..., None])
    pair = pair & (q_first[..., None] != _NO_SEG)
    pair = pair & (jnp.arange(lst.shape[-1]) < cnt[..., None])
    B, K, _, M = lst.shape
    full = pair.reshape(B, K, blocks.ngroups, blocks.gq, M).all(axis=(0, 1, 3))
    return Meta(perm, lst, cnt, trip, full)


def _sort_blocks(x_BxKxNx_, perm_BxKxN):
    """x[b, k, perm[b, k, i]] for every i (x's block axis is 2)."""
    ix = perm_BxKxN.reshape(perm_BxKxN.shape + (1,) * (x_BxKxNx_.ndim - 3))
    return jnp.take_along_axis(x_BxKxNx_, ix, axis=2)


def _unsort_blocks(x_BxKxNx_, perm_BxKxN, n: int):
    """Inverse of _sort_blocks, keeping the first n blocks."""
    return _sort_blocks(x_BxKxNx_, jnp.argsort(perm_BxKxN, axis=-1))[:, :, :n]


def _groups(x_BxKxNx_, blocks: SparseBlocks):
    """[B, K, nqp, ...] -> [ngroups, B, K, gq, ...] (scan's leading axis)."""
    B, K = x_BxKxNx_.shape[:2]
    x = x_BxKxNx_.reshape((B, K, blocks.ngroups, blocks.gq) + x_BxKxNx_.shape[3:])
    return jnp.moveaxis(x, 2, 0)


def _ungroup(x_NGxBxKxGQx_):
    x = jnp.moveaxis(x_NGxBxKxGQx_, 0, 2)
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _gather_blocks(x_BxKxNBx_, idx_BxKxN):
    """x[b, k, idx[b, k, n]] for every n: [B, K, n, ...]."""
    return jax.vmap(jax.vmap(lambda x, i: x[i]))(x_BxKxNBx_, idx_BxKxN)


def _key_blocks(x_BxTxKxD, blocks: SparseBlocks):
    """[B, K, nb + 1, bs, D] float32; block nb (the filler index) is zeros, so a slot past a
    block's count reads no selected block at all (NaN/inf in unselected blocks stays out)."""
    B, _, K, D = x_BxTxKxD.shape
    x = _pad_t(x_BxTxKxD.astype(jnp.float32), blocks.Tp + blocks.bs)
    return x.reshape(B, blocks.nb + 1, blocks.bs, K, D).transpose(0, 3, 1, 2, 4)


def _prepare(q, seg, meta: Meta, blocks: SparseBlocks, K: int):
    """Sorted, grouped query side ([ngroups, B, K, gq, ...]) and the key blocks' segment ids."""
    B, T, H, D = q.shape
    G = H // K
    nb, bs = blocks.nb, blocks.bs
    qt = _to_blocked_q(q * (1.0 / math.sqrt(D)), K, blocks)  # [B, K, nqp, G, bs, D]
    qt = qt.reshape(B, K, blocks.nqp, G * bs, D)
    seg_b = _pad_t(seg, blocks.Tp, mode="edge").reshape(B, nb, bs)
    seg_q = _pad_t(seg_b, blocks.nqp, axis=1, mode="edge")  # filler query blocks: count 0, masked
    seg_q = jnp.broadcast_to(seg_q[:, None], (B, K, blocks.nqp, bs))
    seg_k = _pad_t(seg_b, nb + 1, axis=1, mode="edge")
    seg_k = jnp.broadcast_to(seg_k[:, None], (B, K, nb + 1, bs))
    side = dict(
        q=_groups(_sort_blocks(qt, meta.perm), blocks),
        seg=_groups(_sort_blocks(seg_q, meta.perm), blocks),
        blk=_groups(meta.perm, blocks),
        lst=_groups(meta.lst, blocks),
        cnt=_groups(meta.cnt, blocks),
        trip=meta.trip,
        full=meta.full,
    )
    return side, seg_k


def _step_mask(xs, s, seg_k, blocks: SparseBlocks, transposed: bool = False):
    """The mask of slot s, [B, K, gq, bs_q, bs_k] (transposed:
    [B, K, gq, bs_k, bs_q]): slot below the count, same segment, causal, key not padding."""
    j = xs["lst"][..., s]
    sk = _gather_blocks(seg_k, j)  # [B, K, gq, bs]
    iota = jnp.arange(blocks.bs)
    qpos = xs["blk"][..., None] * blocks.bs + iota  # [B, K, gq, bs]
    kpos = j[..., None] * blocks.bs + iota
    qa, ka = (-1, -2) if transposed else (-2, -1)
    qx = lambda x: jnp.expand_dims(x, ka)
    kx = lambda x: jnp.expand_dims(x, qa)
    mask = (qx(xs["seg"]) == kx(sk)) & (kx(kpos) <= qx(qpos))
    mask = mask & (s < xs["cnt"])[..., None, None]
    if blocks.Tp > blocks.T:
        mask = mask & (kx(kpos) < blocks.T)
    return mask


def _masked_or_not(xs, s, body, operand):
    """lax.cond between body(operand, masked=False) on steps whose every pair needs no mask
    (Meta.full: no mask arithmetic, no pass over the scores to apply it) and
    body(operand, masked=True). The whole step sits inside the cond: a cond that only masked
    the scores would copy them on the unmasked path."""
    return lax.cond(
        xs["full"][s],
        functools.partial(body, masked=False),
        functools.partial(body, masked=True),
        operand,
    )


def _forward(q, k, v, seg, meta: Meta, blocks: SparseBlocks):
    """out [B,T,H,D] (q.dtype) and lse [B,K,nqp,G,bs] (float32, sorted order)."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G, bs, gq = H // K, blocks.bs, blocks.gq
    side, seg_k = _prepare(q, seg, meta, blocks, K)
    kt, vt = _key_blocks(k, blocks), _key_blocks(v, blocks)

    def group(_, xs):
        def body(carry, s, masked):
            m, l, acc = carry  # [B,K,gq,G,bs], same, [B,K,gq,G,bs,D]
            j = xs["lst"][..., s]
            kb, vb = _gather_blocks(kt, j), _gather_blocks(vt, j)
            sc = jnp.einsum("bknmd,bknsd->bknms", xs["q"], kb, precision=_HI)
            sc = sc.reshape(B, K, gq, G, bs, bs)
            if masked:
                sc = jnp.where(_step_mask(xs, s, seg_k, blocks)[:, :, :, None], sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(-1))
            p = jnp.exp(sc - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(-1)
            pv = jnp.einsum("bknms,bknsd->bknmd", p.reshape(B, K, gq, G * bs, bs), vb, precision=_HI)
            acc = alpha[..., None] * acc + pv.reshape(B, K, gq, G, bs, D)
            return m_new, l, acc

        def step(s, carry):
            return _masked_or_not(xs, s, functools.partial(body, s=s), carry)

        init = (
            jnp.full((B, K, gq, G, bs), NEG, jnp.float32),
            jnp.zeros((B, K, gq, G, bs), jnp.float32),
            jnp.zeros((B, K, gq, G, bs, D), jnp.float32),
        )
        m, l, acc = lax.fori_loop(0, xs["trip"], step, init)
        empty = l == 0.0
        out = acc / jnp.where(empty, 1.0, l)[..., None]
        lse = jnp.where(empty, NEG, m + jnp.log(jnp.where(empty, 1.0, l)))
        return None, (out, lse)

    _, (out, lse) = lax.scan(group, None, side)
    out = _unsort_blocks(_ungroup(out), meta.perm, blocks.nb)  # [B, K, nb, G, bs, D]
    return _from_blocked_q(out, blocks.T).astype(q.dtype), _ungroup(lse)


def _from_blocked_q(x_BxKxNxGxBSxD, T):
    B, K, nq, G, bs, D = x_BxKxNxGxBSxD.shape
    return x_BxKxNxGxBSxD.transpose(0, 2, 4, 1, 3, 5).reshape(B, nq * bs, K * G, D)[:, :T]


def _to_blocked_q(x_BxTxHxD, K, blocks: SparseBlocks):
    """[B, K, nqp, G, bs, D] float32, zero-padded to nqp whole blocks."""
    B, T, H, D = x_BxTxHxD.shape
    x = _pad_t(x_BxTxHxD.astype(jnp.float32), blocks.nqp * blocks.bs)
    return x.reshape(B, blocks.nqp, blocks.bs, K, H // K, D).transpose(0, 3, 1, 4, 2, 5)


def _backward(blocks: SparseBlocks, res, do):
    """Scores are built transposed, sT [B, K, gq, bs_k, G*bs_q], so that every matmul of the
    step is a plain or right-transposed product (the forms XLA:CPU hands to its fast GEMM;
    a left-transposed one, p^T @ dO, ran ~3x slower per FLOP): dv += pT @ dO, dk += dsT @ q,
    dqT += kT @ dsT with kT gathered from a transposed copy of k."""
    q, k, v, seg, meta, out, lse = res
    B, T, H, D = q.shape
    K = k.shape[2]
    G, bs, gq = H // K, blocks.bs, blocks.gq
    side, seg_k = _prepare(q, seg, meta, blocks, K)
    kt, vt = _key_blocks(k, blocks), _key_blocks(v, blocks)
    ktt = kt.swapaxes(-1, -2)  # [B, K, nb + 1, D, bs]
    dot = _to_blocked_q(do, K, blocks)  # padded rows get a zero cotangent
    delta = (dot * _to_blocked_q(out, K, blocks)).sum(-1)  # rowsum(dO * O): [B,K,nqp,G,bs]
    side["do"] = _groups(_sort_blocks(dot.reshape(B, K, blocks.nqp, G * bs, D), meta.perm), blocks)
    side["delta"] = _groups(_sort_blocks(delta, meta.perm), blocks)
    side["lse"] = _groups(lse, blocks)
    b_ix = jnp.arange(B)[:, None, None]
    k_ix = jnp.arange(K)[None, :, None]

    def group(dkv, xs):
        lse_g = xs["lse"][:, :, :, None]  # [B, K, gq, 1, G, bs]
        delta_g = xs["delta"][:, :, :, None]

        def body(dqt, s, j, masked):
            kb, vb = _gather_blocks(kt, j), _gather_blocks(vt, j)
            st = jnp.einsum("bknsd,bknmd->bknsm", kb, xs["q"], precision=_HI)
            st = st.reshape(B, K, gq, bs, G, bs)
            if masked:
                mask = _step_mask(xs, s, seg_k, blocks, transposed=True)  # [B,K,gq,bs_k,bs_q]
                st = jnp.where(mask[:, :, :, :, None], st, -jnp.inf)
            pt = jnp.exp(st - lse_g)  # masked: exp(-inf) == 0 exactly
            dpt = jnp.einsum("bknsd,bknmd->bknsm", vb, xs["do"], precision=_HI)
            dst = (pt * (dpt.reshape(pt.shape) - delta_g)).reshape(B, K, gq, bs, G * bs)
            pt = pt.reshape(B, K, gq, bs, G * bs)
            dv_s = jnp.einsum("bknsm,bknmd->bknsd", pt, xs["do"], precision=_HI)
            dk_s = jnp.einsum("bknsm,bknmd->bknsd", dst, xs["q"], precision=_HI)  # q holds the scale
            dqt = dqt + jnp.einsum("bknds,bknsm->bkndm", _gather_blocks(ktt, j), dst, precision=_HI)
            return dqt, dk_s, dv_s

        def step(s, carry):
            dqt, dk, dv = carry
            j = xs["lst"][..., s]
            # the scatter stays outside the cond: dk/dv would be copied through it otherwise
            dqt, dk_s, dv_s = _masked_or_not(xs, s, functools.partial(body, s=s, j=j), dqt)
            dk = dk.at[b_ix, k_ix, j].add(dk_s)
            dv = dv.at[b_ix, k_ix, j].add(dv_s)
            return dqt, dk, dv

        dqt0 = jnp.zeros((B, K, gq, D, G * bs), jnp.float32)
        dqt, dk, dv = lax.fori_loop(0, xs["trip"], step, (dqt0,) + dkv)
        return (dk, dv), dqt.swapaxes(-1, -2)

    zeros_kv = jnp.zeros((B, K, blocks.nb + 1, bs, D), jnp.float32)  # block nb: filler, dropped
    (dk, dv), dq = lax.scan(group, (zeros_kv, zeros_kv), side)

    def kv_out(x_BxKxNBxBSxD, like):
        x = x_BxKxNBxBSxD[:, :, : blocks.nb].transpose(0, 2, 3, 1, 4).reshape(B, blocks.Tp, K, D)
        return x[:, : blocks.T].astype(like.dtype)

    dq = _unsort_blocks(_ungroup(dq), meta.perm, blocks.nb).reshape(B, K, blocks.nb, G, bs, D)
    dq = _from_blocked_q(dq * (1.0 / math.sqrt(D)), blocks.T).astype(q.dtype)
    return dq, kv_out(dk, k), kv_out(dv, v), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _sparse(q, k, v, seg, meta, blocks):
    return _forward(q, k, v, seg, meta, blocks)[0]


def _sparse_fwd(q, k, v, seg, meta, blocks):
    out, lse = _forward(q, k, v, seg, meta, blocks)
    return out, (q, k, v, seg, meta, out, lse)


_sparse.defvjp(_sparse_fwd, _backward)


def block_sparse_attention_xla(
    q, k, v, block_indices, block_counts, segment_ids, block_size, group_size: int | None = None
):
    """Arguments are assumed checked (see ops.block_sparse_attention). group_size: query
    blocks per loop step (None: from SCORE_TILE_BYTES; any value gives the same result)."""
    B, T, H, _ = q.shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    blocks = make_sparse_blocks(B, T, H, k.shape[2], block_size, group_size)
    meta = _metadata(block_indices, block_counts, seg, blocks)
    return _sparse(q, k, v, seg, meta, blocks)
