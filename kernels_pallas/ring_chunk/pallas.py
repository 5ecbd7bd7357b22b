"""The chunk op in Pallas: forward (out, lse), dQ and dK/dV kernels of one chunk pair.

Three `pl.pallas_call`s in the shape of the flash kernels (flash_attention/pallas.py), with
their arithmetic: matmuls in the input dtype accumulating in float32, everything else float32:
  * forward, grid (B, H, nq): one query block per program, online softmax over the key blocks
    of its visit range; writes the block's float32 output and lse;
  * dQ, grid (B, H, nq): same walk, p = exp(s - lse) from the caller's (global) lse;
  * dK/dV, grid (B, K, nk): one key block per program, looping over the G = H // K query
    heads that share it (GQA) and the query blocks of its visit range.
What differs from the flash kernels is the mask: per token (segment id, position) on both
sides, query i sees key j iff seg_q[i] == seg_k[j] and pos_k[j] <= pos_q[i], so any token
order works; block indices say nothing about causality here.

Work skipping, per batch row and kv head: `tables.py` summarises each block by its (id,
position) ranges outside the kernels and derives the [B, nq, nk] SKIP / FULL / PARTIAL table,
repeated per kv head ([B, K, nq, nk]; a program of query head h reads row h // G) and, given a
block selection `select` [B, K, nq, nk] (block-sparse ring rounds, jaxsb/parallel/ring_sparse.py),
SKIP wherever it is False; then, per query block (key block), the [first, last + 1) range of
key (query) blocks that are not SKIP.
A program loops over that range only and a `lax.cond` on the pair's kind skips SKIP pairs
inside it and masks the others (FULL ones too: one copy of the body, `common.unless_skip`);
skipped blocks are never loaded. A device whose ring round is idle passes active=False: every pair is SKIP and every
range empty, so its programs only write zeros.

Layout inside: q/o [B, Lqp, H, Dp] (viewed as [B, Lqp, K, G, Dp] by the dK/dV kernel), k/v
[B, Lkp, K, Dp] (the caller's layout, padded only: common.triton_layout), lse and delta
[B, H, Lqp]; ids and positions [B, L] int32. Lqp / Lkp are whole blocks (fill ids match
nothing), Dp is D padded to a power of two >= 16 (zero columns change no score).

GPU: compiled kernels go through the Triton lowering with explicit compiler params
(`common.triton_compiler_params`), like flash_attention/pallas.py. Under
`shard_map(check_vma=True)` the out_shapes carry the inputs' varying mesh axes; the Pallas
interpreter of JAX 0.10 does not track them, so interpreted kernels need check_vma=False
there (ring.py says so up front).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common import NEG, NN, NT, TN, backward_blocks, pad_axis, triton_compiler_params, triton_dot as _mm, unless_skip
from kernels_pallas.common import group_block, head_block, kv_group_rows, kv_groups, out_struct as _out_struct
from kernels_pallas.common import triton_layout, triton_unlayout
from kernels_pallas.ring_chunk import tables
from kernels_pallas.ring_chunk.tables import SKIP, ChunkBlocks

# ----------------------------------------------------------------------------- kernels


def _mask(sq, pq, sk, pk):
    """[bq, bk] bool: same segment and key position <= query position."""
    return (sq[:, None] == sk[None, :]) & (pk[None, :] <= pq[:, None])


def _fwd_kernel(kinds_ref, krange_ref, sq_ref, pq_ref, sk_ref, pk_ref, q_ref, k_ref, v_ref,
                o_ref, lse_ref, *, blocks: ChunkBlocks):
    bq, bk, Dp = blocks.bq, blocks.bk, blocks.Dp
    q = q_ref[...]  # [bq, Dp]
    sq, pq = sq_ref[...], pq_ref[...]

    def update(carry, ki):
        m, l, acc = carry
        k_slice = pl.ds(pl.multiple_of(ki * bk, bk), bk)
        k = k_ref[k_slice, :]
        v = v_ref[k_slice, :]
        mask = _mask(sq, pq, sk_ref[k_slice], pk_ref[k_slice])
        s = jnp.where(mask, _mm(q, k, NT, blocks.interpret) * blocks.scale, NEG)  # [bq, bk]
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # a row with nothing allowed keeps l == 0
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        acc = alpha[:, None] * acc + _mm(p.astype(v.dtype), v, NN, blocks.interpret)
        return m_new, l, acc

    def body(ki, carry):
        return unless_skip(kinds_ref[ki], SKIP, functools.partial(update, ki=ki), carry)

    init = (jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros((bq, Dp), jnp.float32))
    m, l, acc = lax.fori_loop(krange_ref[0], krange_ref[1], body, init)
    l = jnp.where(l == 0.0, 1.0, l)  # no allowed key in this chunk: out 0, lse NEG
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(kinds_ref, krange_ref, sq_ref, pq_ref, sk_ref, pk_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, dq_ref, *, blocks: ChunkBlocks):
    bq, bk, Dp = blocks.bq, blocks.bk, blocks.Dp
    q = q_ref[...]
    do = do_ref[...].astype(q.dtype)
    lse, delta = lse_ref[...], delta_ref[...]
    sq, pq = sq_ref[...], pq_ref[...]

    def update(dq, ki):
        k_slice = pl.ds(pl.multiple_of(ki * bk, bk), bk)
        k = k_ref[k_slice, :]
        v = v_ref[k_slice, :]
        p = jnp.exp(_mm(q, k, NT, blocks.interpret) * blocks.scale - lse[:, None])
        p = jnp.where(_mask(sq, pq, sk_ref[k_slice], pk_ref[k_slice]), p, 0.0)
        ds = p * (_mm(do, v, NT, blocks.interpret) - delta[:, None])
        return dq + _mm(ds.astype(k.dtype), k, NN, blocks.interpret)

    def body(ki, dq):
        return unless_skip(kinds_ref[ki], SKIP, functools.partial(update, ki=ki), dq)

    dq = lax.fori_loop(krange_ref[0], krange_ref[1], body, jnp.zeros((bq, Dp), jnp.float32))
    dq_ref[...] = (dq * blocks.scale).astype(dq_ref.dtype)


def _dkv_kernel(kinds_ref, qrange_ref, sq_ref, pq_ref, sk_ref, pk_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, blocks: ChunkBlocks, G: int):
    bq, bk, Dp = blocks.bq, blocks.bk, blocks.Dp
    k = k_ref[...]  # [bk, Dp]
    v = v_ref[...]
    sk, pk = sk_ref[...], pk_ref[...]

    def update(carry, g, qi):
        dk, dv = carry
        q_slice = pl.ds(pl.multiple_of(qi * bq, bq), bq)
        q = q_ref[q_slice, g, :]
        do = do_ref[q_slice, g, :].astype(q.dtype)
        p = jnp.exp(_mm(q, k, NT, blocks.interpret) * blocks.scale - lse_ref[g, q_slice][:, None])  # [bq, bk]
        p = jnp.where(_mask(sq_ref[q_slice], pq_ref[q_slice], sk, pk), p, 0.0)
        dv = dv + _mm(p.astype(do.dtype), do, TN, blocks.interpret)
        ds = p * (_mm(do, v, NT, blocks.interpret) - delta_ref[g, q_slice][:, None])
        dk = dk + _mm(ds.astype(q.dtype), q, TN, blocks.interpret)  # the scale is applied once, at the end
        return dk, dv

    def per_head(g, carry):
        def body(qi, carry):
            return unless_skip(kinds_ref[qi], SKIP, functools.partial(update, g=g, qi=qi), carry)

        return lax.fori_loop(qrange_ref[0], qrange_ref[1], body, carry)

    zeros = jnp.zeros((bk, Dp), jnp.float32)
    dk, dv = lax.fori_loop(0, G, per_head, (zeros, zeros))
    dk_ref[...] = (dk * blocks.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls


def _layout(x_BxLxNxD, Lp, blocks: ChunkBlocks):
    """[B, L, N, D] -> [B, Lp, N, Dp] (common.triton_layout: zero padding), dtype kept."""
    return triton_layout(x_BxLxNxD, Lp, blocks.Dp)


def _unlayout(x_BxLpxNxDp, L, blocks: ChunkBlocks):
    return triton_unlayout(x_BxLpxNxDp, L, blocks.D, x_BxLpxNxDp.dtype)


def _rows(x_BxLxH, Lp):
    """Per-query scalars [B, L, H] -> float32 [B, H, Lp]."""
    return pad_axis(x_BxLxH.astype(jnp.float32), 1, Lp).transpose(0, 2, 1)


def _tables(seg_q, pos_q, seg_k, pos_k, active, blocks: ChunkBlocks, K: int, select=None):
    """Padded ids and positions and the kinds per row and kv head [B, K, nq, nk] (see
    tables.py): the row's kinds for every kv head, SKIP where `select` [B, K, nq, nk]
    (bool, optional) leaves a pair out."""
    sq, pq = tables.pad_ids(seg_q, pos_q, blocks.Lqp, tables.Q_FILL)
    sk, pk = tables.pad_ids(seg_k, pos_k, blocks.Lkp, tables.K_FILL)
    allowed, full = tables.pair_flags(tables.block_summaries(sq, pq, blocks.bq),
                                      tables.block_summaries(sk, pk, blocks.bk),
                                      blocks.bq, blocks.bk, blocks.local)
    kinds = tables.row_kinds(allowed, full, active)[:, None]
    B, _, nq, nk = kinds.shape
    if select is None:
        return (sq, pq, sk, pk), jnp.broadcast_to(kinds, (B, K, nq, nk))
    return (sq, pq, sk, pk), jnp.where(select, kinds, SKIP).astype(jnp.int32)


def _call(kernel, name, grid, in_specs, out_specs, out_shape, blocks: ChunkBlocks):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=blocks.interpret, compiler_params=triton_compiler_params(blocks.interpret, blocks.bq * blocks.bk),
        name=name)


def chunk_forward_pallas(q, k, v, seg_q, pos_q, seg_k, pos_k, active, blocks: ChunkBlocks,
                         select=None, out_dtype=jnp.float32):
    """out [B, Lq, H, D] in out_dtype and lse float32 [B, Lq, H] of one chunk pair (only the
    block pairs `select` [B, K, nq, nk] keeps, if given)."""
    B, _, H, _ = q.shape
    G = H // k.shape[2]
    bq, Dp, Lkp, nk = blocks.bq, blocks.Dp, blocks.Lkp, blocks.nk
    ids, kinds = _tables(seg_q, pos_q, seg_k, pos_k, active, blocks, k.shape[2], select)
    qt, kt, vt = _layout(q, blocks.Lqp, blocks), _layout(k, Lkp, blocks), _layout(v, Lkp, blocks)
    q_ids = pl.BlockSpec((None, bq), lambda b, h, i: (b, i))
    k_ids = pl.BlockSpec((None, Lkp), lambda b, h, i: (b, 0))
    kv = head_block(Lkp, Dp, lambda b, h, i: (b, 0, h // G))
    o, lse = _call(
        functools.partial(_fwd_kernel, blocks=blocks), "ring_chunk_fwd", (B, H, blocks.nq),
        [
            pl.BlockSpec((None, None, None, nk), lambda b, h, i: (b, h // G, i, 0)),  # kinds row
            pl.BlockSpec((None, None, None, 2), lambda b, h, i: (b, h // G, i, 0)),  # key range
            q_ids, q_ids, k_ids, k_ids,
            head_block(bq, Dp, lambda b, h, i: (b, i, h)),
            kv, kv,
        ],
        [
            head_block(bq, Dp, lambda b, h, i: (b, i, h)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        ],
        [_out_struct((B, blocks.Lqp, H, Dp), out_dtype, qt),
         _out_struct((B, H, blocks.Lqp), jnp.float32, qt)],
        blocks,
    )(kinds, tables.visit_ranges(kinds), *ids, qt, kt, vt)
    return _unlayout(o, blocks.Lq, blocks), lse[:, :, : blocks.Lq].transpose(0, 2, 1)


def backward_select(select, blocks: ChunkBlocks):
    """A block selection [B, K, nq, nk] under the forward's blocks -> the same pairs under
    `common.backward_blocks` (each entry repeated over the tiles of its block); None stays None."""
    if select is None:
        return None
    bw = backward_blocks(blocks)
    select = jnp.repeat(jnp.repeat(select, blocks.bq // bw.bq, 2), blocks.bk // bw.bk, 3)
    return select[:, :, : bw.nq, : bw.nk]


def chunk_backward_pallas(q, k, v, seg_q, pos_q, seg_k, pos_k, do, lse, delta, active,
                          blocks: ChunkBlocks, select=None, grad_dtype=jnp.float32, out=None):
    """dq [B, Lq, H, D], dk and dv [B, Lk, K, D] in grad_dtype of one chunk pair, given the global
    lse and delta = rowsum(dO * O) [B, Lq, H] of the queries (`select` as in the forward,
    `out`: tables.output_delta)."""
    delta = tables.output_delta(do, out, delta)
    B, _, H, _ = q.shape
    K = k.shape[2]
    G = H // K
    select = backward_select(select, blocks)
    blocks = backward_blocks(blocks)
    bq, bk, Dp = blocks.bq, blocks.bk, blocks.Dp
    Lqp, Lkp, nq, nk = blocks.Lqp, blocks.Lkp, blocks.nq, blocks.nk
    ids, kinds = _tables(seg_q, pos_q, seg_k, pos_k, active, blocks, K, select)
    kinds_t = kinds.transpose(0, 1, 3, 2)  # [B, K, nk, nq]: per key block
    k_range = tables.visit_ranges(kinds)
    q_range = tables.visit_ranges(kinds_t)
    qt, kt, vt = _layout(q, Lqp, blocks), _layout(k, Lkp, blocks), _layout(v, Lkp, blocks)
    dot_ = _layout(do, Lqp, blocks)  # fill rows and columns get a zero cotangent
    lse_t, delta_t = _rows(lse, Lqp), _rows(delta, Lqp)  # fill rows: never unmasked

    q_ids = pl.BlockSpec((None, bq), lambda b, h, i: (b, i))
    k_ids = pl.BlockSpec((None, Lkp), lambda b, h, i: (b, 0))
    q_blk = head_block(bq, Dp, lambda b, h, i: (b, i, h))
    kv_all = head_block(Lkp, Dp, lambda b, h, i: (b, 0, h // G))
    q_row = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    dq = _call(
        functools.partial(_dq_kernel, blocks=blocks), "ring_chunk_dq", (B, H, nq),
        [
            pl.BlockSpec((None, None, None, nk), lambda b, h, i: (b, h // G, i, 0)),
            pl.BlockSpec((None, None, None, 2), lambda b, h, i: (b, h // G, i, 0)),
            q_ids, q_ids, k_ids, k_ids, q_blk, kv_all, kv_all, q_blk, q_row, q_row,
        ],
        q_blk, _out_struct((B, Lqp, H, Dp), grad_dtype, qt), blocks,
    )(kinds, k_range, *ids, qt, kt, vt, dot_, lse_t, delta_t)

    # Query-side arrays per kv head: common.kv_groups / kv_group_rows (free reshapes).
    q_all_ids = pl.BlockSpec((None, Lqp), lambda b, h, j: (b, 0))
    k_blk_ids = pl.BlockSpec((None, bk), lambda b, h, j: (b, j))
    q_all = group_block(Lqp, G, Dp, lambda b, h, j: (b, h))
    kv_blk = head_block(bk, Dp, lambda b, h, j: (b, j, h))
    rows_all = pl.BlockSpec((None, None, G, Lqp), lambda b, h, j: (b, h, 0, 0))
    dk, dv = _call(
        functools.partial(_dkv_kernel, blocks=blocks, G=G), "ring_chunk_dkv", (B, K, nk),
        [
            pl.BlockSpec((None, None, None, nq), lambda b, h, j: (b, h, j, 0)),
            pl.BlockSpec((None, None, None, 2), lambda b, h, j: (b, h, j, 0)),
            q_all_ids, q_all_ids, k_blk_ids, k_blk_ids,
            q_all, kv_blk, kv_blk, q_all, rows_all, rows_all,
        ],
        [kv_blk, kv_blk],
        [_out_struct((B, Lkp, K, Dp), grad_dtype, kt)] * 2,
        blocks,
    )(kinds_t, q_range, *ids, kv_groups(qt, K), kt, vt, kv_groups(dot_, K),
      kv_group_rows(lse_t, K), kv_group_rows(delta_t, K))
    return (_unlayout(dq, blocks.Lq, blocks), _unlayout(dk, blocks.Lk, blocks),
            _unlayout(dv, blocks.Lk, blocks))
