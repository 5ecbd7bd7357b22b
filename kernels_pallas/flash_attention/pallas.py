"""Pallas flash attention (FlashAttention-2): forward, dQ and dK/dV kernels, `jax.custom_vjp`.

Three `pl.pallas_call`s. Matmuls take their operands in the input dtype and accumulate in
float32 (bf16 inputs reach the tensor cores; float32 ones stay float32 at full precision), as
FlashAttention-2 does: the probabilities and dS are rounded to the input dtype for their
matmuls, everything else (softmax, running max and sum, accumulators) is float32. Upcasting
the operands instead made Triton emit scalar FMA loops: ~15x slower to compile (and to run).
  * forward, grid (B, H, nq): one query block per program, online softmax over the key blocks
    it can see; writes the output and the per-query log-sum-exp (lse);
  * dQ, grid (B, H, nq): same walk, recomputes p = exp(s - lse) and accumulates dQ;
  * dK/dV, grid (B, K, nk): one key block per program; loops over the G = H // K query heads
    that share it (GQA) and the query blocks that can see it, accumulating dK and dV.
delta = rowsum(dO * O) is a cheap elementwise pass done in jnp before the backward kernels.

Layout inside: q/o [B, Tq, H, Dp] (viewed as [B, Tq, K, G, Dp] by the dK/dV kernel, so query
head h = kv_head * G + g reads kv head h // G), k/v [B, Tk, K, Dp]: the caller's [B, T, N, D],
padded only (`common.triton_layout`; a kernel reads one head's rows with a stride, as JAX's
own GPU attention does, so no transpose is compiled or run); lse and delta [B, H, Tq]. Dp is D
padded up to a power of two >= 16 (the Triton lowering wants power-of-two loads and dot sizes
>= 16); the padded columns are zeros, change no score, and are sliced off.

Work skipping, per batch row (each program knows its row): `block_tables` classifies every
(query block, key block) pair from per-block segment-id ranges as SKIP / FULL / PARTIAL (the
same conservative rule as xla.block_kinds, not reduced over the batch) and derives, for each
query block, the [first, last + 1) range of key blocks that are not SKIP (and the transpose for
each key block). The kernels loop only over that range (so causal pairs above the diagonal and
documents far away cost nothing), and inside it a `lax.cond` on the pair's kind runs nothing
for SKIP pairs in the middle of the range (e.g. a query block holding a document and padding
sees the first document's key blocks and the padding's, not the ones between) and the masked
update for the others (FULL pairs too: one copy of the body, `common.unless_skip`).

Padding: T is padded to whole blocks (Tq, Tk). Padded queries copy the last real segment id
(they see real keys; their outputs are sliced off and their cotangent is zero); padded keys are
removed by a position mask (j < T), and the last key block is never FULL when Tk > T.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common import NEG, BlockGrid, NN as _NN, NT as _NT, TN as _TN, triton_dot as _mm
from kernels_pallas.common import next_pow2 as _next_pow2, pad_axis, range_of_true
from kernels_pallas.common import backward_blocks, triton_compiler_params, unless_skip
from kernels_pallas.common import group_block, head_block, kv_group_rows, kv_groups, row_delta
from kernels_pallas.common import triton_layout, triton_unlayout

SKIP, FULL, PARTIAL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class FlashTritonBlocks(BlockGrid):
    """The block grid of one call, with the head dim padded for Triton."""

    @property
    def Dp(self) -> int:
        return max(16, _next_pow2(self.D))


def make_flash_triton_blocks(T: int, D: int, causal: bool, block_q: int, block_k: int,
                             interpret: bool) -> FlashTritonBlocks:
    """Blocks longer than the sequence are shrunk to the next power of two >= T (>= 16)."""
    cap = max(16, _next_pow2(T))
    blocks = FlashTritonBlocks(T, D, min(block_q, cap), min(block_k, cap), bool(causal),
                               bool(interpret))
    if not interpret:
        for name, b in (("block_q", blocks.bq), ("block_k", blocks.bk)):
            if b & (b - 1) or b < 16:
                raise ValueError(
                    f"{name}={b} must be a power of two >= 16 for compiled Pallas "
                    f"(got {block_q=}, {block_k=}, T={T})"
                )
    return blocks


# ----------------------------------------------------------------------------- block tables


def _static_reachable(blocks: BlockGrid) -> np.ndarray:
    qi = np.arange(blocks.nq)[:, None]
    ki = np.arange(blocks.nk)[None, :]
    if not blocks.causal:
        return np.ones((blocks.nq, blocks.nk), dtype=bool)
    return ki * blocks.bk <= (qi + 1) * blocks.bq - 1  # first key <= last query


def _static_full(blocks: BlockGrid) -> np.ndarray:
    qi = np.arange(blocks.nq)[:, None]
    ki = np.arange(blocks.nk)[None, :]
    full = np.ones((blocks.nq, blocks.nk), dtype=bool)
    if blocks.causal:
        full &= (ki + 1) * blocks.bk - 1 <= qi * blocks.bq  # last key <= first query
    if blocks.Tk > blocks.T:
        full &= ki != blocks.nk - 1  # holds padded keys
    return full


def block_summary(seg_BxT, block: int):
    """Per block of `block` tokens, each [B, n]: (lowest nonzero id, highest nonzero id, holds
    padding (id 0), lowest id, highest id). T must be a multiple of `block`."""
    big = jnp.iinfo(jnp.int32).max
    s = seg_BxT.reshape(seg_BxT.shape[0], -1, block)
    nonzero = s != 0
    return (
        jnp.where(nonzero, s, big).min(-1),
        jnp.where(nonzero, s, -big).max(-1),
        (~nonzero).any(-1),
        s.min(-1),
        s.max(-1),
    )


def block_tables(seg_q_BxTq, seg_k_BxTk, blocks: BlockGrid):
    """Per-row block metadata: kinds [B, nq, nk] (SKIP / FULL / PARTIAL), k_range [B, nq, 2]
    (key blocks a query block visits) and q_range [B, nk, 2] (query blocks a key block visits).

    A pair is SKIP only if the ranges of nonzero ids of the two blocks do not overlap and not
    both blocks hold padding (id 0), which implies no equal ids; conservative for any ids, and
    tight for packed rows (contiguous documents, padding at the end).
    """
    qlo, qhi, q0, qmin, qmax = (x[:, :, None] for x in block_summary(seg_q_BxTq, blocks.bq))
    klo, khi, k0, kmin, kmax = (x[:, None, :] for x in block_summary(seg_k_BxTk, blocks.bk))
    overlap = (jnp.maximum(qlo, klo) <= jnp.minimum(qhi, khi)) | (q0 & k0)
    uniform = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
    visit = overlap & jnp.asarray(_static_reachable(blocks))[None]
    full = uniform & jnp.asarray(_static_full(blocks))[None]
    kinds = jnp.where(visit, jnp.where(full, FULL, PARTIAL), SKIP).astype(jnp.int32)
    return kinds, range_of_true(visit), range_of_true(visit.transpose(0, 2, 1))


# ----------------------------------------------------------------------------- kernels


def _mask(sq, sk, q_start, k_start, blocks: FlashTritonBlocks, shape):
    """[bq, bk] bool for one PARTIAL pair: same segment, causal, key not padding."""
    mask = sq[:, None] == sk[None, :]
    kpos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    if blocks.causal:
        qpos = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
        mask = mask & (kpos <= qpos)
    if blocks.Tk > blocks.T:
        mask = mask & (kpos < blocks.T)
    return mask


def _fwd_kernel(kinds_ref, krange_ref, sq_ref, sk_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                *, blocks: FlashTritonBlocks):
    bq, bk, Dp = blocks.bq, blocks.bk, blocks.Dp
    q_start = pl.program_id(2) * bq
    q = q_ref[...]  # [bq, Dp]
    sq = sq_ref[...]

    def update(carry, ki):
        m, l, acc = carry
        k_slice = pl.ds(pl.multiple_of(ki * bk, bk), bk)
        k = k_ref[k_slice, :]
        v = v_ref[k_slice, :]
        mask = _mask(sq, sk_ref[k_slice], q_start, ki * bk, blocks, (bq, bk))
        s = jnp.where(mask, _mm(q, k, _NT, blocks.interpret) * blocks.scale, NEG)  # [bq, bk]
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        acc = alpha[:, None] * acc + _mm(p.astype(v.dtype), v, _NN, blocks.interpret)
        return m_new, l, acc

    def body(ki, carry):
        return unless_skip(kinds_ref[ki], SKIP, functools.partial(update, ki=ki), carry)

    init = (
        jnp.full((bq,), NEG, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, Dp), jnp.float32),
    )
    m, l, acc = lax.fori_loop(krange_ref[0], krange_ref[1], body, init)
    l = jnp.where(l == 0.0, 1.0, l)  # unreachable for real rows; keeps lse finite anyway
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(kinds_ref, krange_ref, sq_ref, sk_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, blocks: FlashTritonBlocks):
    bq, bk, Dp = blocks.bq, blocks.bk, blocks.Dp
    q_start = pl.program_id(2) * bq
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    sq = sq_ref[...]

    def update(dq, ki):
        k_slice = pl.ds(pl.multiple_of(ki * bk, bk), bk)
        k = k_ref[k_slice, :]
        v = v_ref[k_slice, :]
        p = jnp.exp(_mm(q, k, _NT, blocks.interpret) * blocks.scale - lse[:, None])
        p = jnp.where(_mask(sq, sk_ref[k_slice], q_start, ki * bk, blocks, (bq, bk)), p, 0.0)
        ds = p * (_mm(do, v, _NT, blocks.interpret) - delta[:, None])
        return dq + _mm(ds.astype(k.dtype), k, _NN, blocks.interpret)

    def body(ki, dq):
        return unless_skip(kinds_ref[ki], SKIP, functools.partial(update, ki=ki), dq)

    dq = lax.fori_loop(krange_ref[0], krange_ref[1], body, jnp.zeros((bq, Dp), jnp.float32))
    dq_ref[...] = (dq * blocks.scale).astype(dq_ref.dtype)


def _dkv_kernel(kinds_ref, qrange_ref, sq_ref, sk_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *, blocks: FlashTritonBlocks, G: int):
    bq, bk, Dp = blocks.bq, blocks.bk, blocks.Dp
    k_start = pl.program_id(2) * bk
    k = k_ref[...]  # [bk, Dp]
    v = v_ref[...]
    sk = sk_ref[...]

    def update(carry, g, qi):
        dk, dv = carry
        q_slice = pl.ds(pl.multiple_of(qi * bq, bq), bq)
        q = q_ref[q_slice, g, :]
        do = do_ref[q_slice, g, :]
        p = jnp.exp(_mm(q, k, _NT, blocks.interpret) * blocks.scale - lse_ref[g, q_slice][:, None])  # [bq, bk]
        p = jnp.where(_mask(sq_ref[q_slice], sk, qi * bq, k_start, blocks, (bq, bk)), p, 0.0)
        dv = dv + _mm(p.astype(do.dtype), do, _TN, blocks.interpret)
        ds = p * (_mm(do, v, _NT, blocks.interpret) - delta_ref[g, q_slice][:, None])
        dk = dk + _mm(ds.astype(q.dtype), q, _TN, blocks.interpret)  # the scale is applied once, at the end
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


def _segs(seg, blocks: FlashTritonBlocks):
    return pad_axis(seg, 1, blocks.Tq, mode="edge"), pad_axis(seg, 1, blocks.Tk, mode="edge")


def _forward(q, k, v, seg, blocks: FlashTritonBlocks):
    B, _, H, _ = q.shape
    K = k.shape[2]
    G = H // K
    bq, Dp = blocks.bq, blocks.Dp
    seg_q, seg_k = _segs(seg, blocks)
    kinds, k_range, _ = block_tables(seg_q, seg_k, blocks)
    qt = triton_layout(q, blocks.Tq, Dp)
    kt, vt = triton_layout(k, blocks.Tk, Dp), triton_layout(v, blocks.Tk, Dp)
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, blocks=blocks),
        grid=(B, H, blocks.nq),
        in_specs=[
            pl.BlockSpec((None, None, blocks.nk), lambda b, h, i: (b, i, 0)),  # kinds row
            pl.BlockSpec((None, None, 2), lambda b, h, i: (b, i, 0)),  # key-block range
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),  # seg_q block
            pl.BlockSpec((None, blocks.Tk), lambda b, h, i: (b, 0)),  # seg_k row
            head_block(bq, Dp, lambda b, h, i: (b, i, h)),
            head_block(blocks.Tk, Dp, lambda b, h, i: (b, 0, h // G)),
            head_block(blocks.Tk, Dp, lambda b, h, i: (b, 0, h // G)),
        ],
        out_specs=[
            head_block(bq, Dp, lambda b, h, i: (b, i, h)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, blocks.Tq, H, Dp), q.dtype),
            jax.ShapeDtypeStruct((B, H, blocks.Tq), jnp.float32),
        ],
        interpret=blocks.interpret,
        compiler_params=triton_compiler_params(blocks.interpret, blocks.bq * blocks.bk),
        name="flash_attention_fwd",
    )(kinds, k_range, seg_q, seg_k, qt, kt, vt)
    return o, lse


def _backward(fwd_blocks: FlashTritonBlocks, res, do):
    q, k, v, seg, o, lse = res
    B, _, H, _ = q.shape
    K = k.shape[2]
    G = H // K
    blocks = backward_blocks(fwd_blocks)
    bq, bk, Dp, Tq, Tk = blocks.bq, blocks.bk, blocks.Dp, blocks.Tq, blocks.Tk
    seg_q, seg_k = _segs(seg, blocks)
    kinds, k_range, q_range = block_tables(seg_q, seg_k, blocks)
    qt, kt, vt = triton_layout(q, Tq, Dp), triton_layout(k, Tk, Dp), triton_layout(v, Tk, Dp)
    dot = triton_layout(do, Tq, Dp)  # padded rows and columns get a zero cotangent
    lse = lse[:, :, :Tq]
    delta = row_delta(dot, o[:, :Tq])  # [B, H, Tq]

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, blocks=blocks),
        grid=(B, H, blocks.nq),
        in_specs=[
            pl.BlockSpec((None, None, blocks.nk), lambda b, h, i: (b, i, 0)),
            pl.BlockSpec((None, None, 2), lambda b, h, i: (b, i, 0)),
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, Tk), lambda b, h, i: (b, 0)),
            head_block(bq, Dp, lambda b, h, i: (b, i, h)),  # q
            head_block(Tk, Dp, lambda b, h, i: (b, 0, h // G)),  # k
            head_block(Tk, Dp, lambda b, h, i: (b, 0, h // G)),  # v
            head_block(bq, Dp, lambda b, h, i: (b, i, h)),  # do
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),  # lse
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),  # delta
        ],
        out_specs=head_block(bq, Dp, lambda b, h, i: (b, i, h)),
        out_shape=jax.ShapeDtypeStruct((B, Tq, H, Dp), q.dtype),
        interpret=blocks.interpret,
        compiler_params=triton_compiler_params(blocks.interpret, blocks.bq * blocks.bk),
        name="flash_attention_dq",
    )(kinds, k_range, seg_q, seg_k, qt, kt, vt, dot, lse, delta)

    # Query-side arrays per kv head: common.kv_groups / kv_group_rows (free reshapes).
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, blocks=blocks, G=G),
        grid=(B, K, blocks.nk),
        in_specs=[
            pl.BlockSpec((None, None, blocks.nq), lambda b, h, j: (b, j, 0)),
            pl.BlockSpec((None, None, 2), lambda b, h, j: (b, j, 0)),
            pl.BlockSpec((None, Tq), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
            group_block(Tq, G, Dp, lambda b, h, j: (b, h)),  # q
            head_block(bk, Dp, lambda b, h, j: (b, j, h)),  # k
            head_block(bk, Dp, lambda b, h, j: (b, j, h)),  # v
            group_block(Tq, G, Dp, lambda b, h, j: (b, h)),  # do
            pl.BlockSpec((None, None, G, Tq), lambda b, h, j: (b, h, 0, 0)),  # lse
            pl.BlockSpec((None, None, G, Tq), lambda b, h, j: (b, h, 0, 0)),  # delta
        ],
        out_specs=[
            head_block(bk, Dp, lambda b, h, j: (b, j, h)),
            head_block(bk, Dp, lambda b, h, j: (b, j, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tk, K, Dp), k.dtype),
            jax.ShapeDtypeStruct((B, Tk, K, Dp), v.dtype),
        ],
        interpret=blocks.interpret,
        compiler_params=triton_compiler_params(blocks.interpret, blocks.bq * blocks.bk),
        name="flash_attention_dkv",
    )(
        kinds.transpose(0, 2, 1), q_range, seg_q, seg_k,
        kv_groups(qt, K), kt, vt, kv_groups(dot, K), kv_group_rows(lse, K), kv_group_rows(delta, K),
    )
    return (
        triton_unlayout(dq, blocks.T, blocks.D, q.dtype),
        triton_unlayout(dk, blocks.T, blocks.D, k.dtype),
        triton_unlayout(dv, blocks.T, blocks.D, v.dtype),
        None,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, blocks):
    return triton_unlayout(_forward(q, k, v, seg, blocks)[0], blocks.T, blocks.D, q.dtype)


def _flash_fwd(q, k, v, seg, blocks):
    o, lse = _forward(q, k, v, seg, blocks)
    return triton_unlayout(o, blocks.T, blocks.D, q.dtype), (q, k, v, seg, o, lse)


_flash.defvjp(_flash_fwd, _backward)


def flash_attention_pallas(
    q, k, v, segment_ids, causal: bool, block_q: int, block_k: int, interpret: bool
):
    """Pallas flash attention; arguments are assumed checked (see ops.flash_attention).

    interpret=True runs the kernels in the Pallas interpreter (any backend, e.g. CPU tests).
    """
    B, T, _, D = q.shape
    if segment_ids is None:
        seg = jnp.ones((B, T), jnp.int32)
    else:
        seg = segment_ids.astype(jnp.int32)
    return _flash(q, k, v, seg, make_flash_triton_blocks(T, D, causal, block_q, block_k, interpret))
