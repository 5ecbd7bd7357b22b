"""Block-sparse attention on TPU: the Mosaic kernels of `kernels_pallas/mosaic.py` with a walk
over explicit block lists (`mosaic.attention` holds the `jax.custom_vjp`).

Both walks come from the GPU kernels' selection matrix (`pallas.selection`: valid slot, index in
range, not in the future; repeats count once), so both backends compute the same pairs:
  * forward and dQ, grid (B, H, nq, W): `pallas.compact`'s table [B, K, nq, 1 + W] (count,
    then the selected key blocks ascending); step s fetches the s-th listed key block through
    the k/v index maps (so only listed blocks are copied) and computes while s < count; past
    the count it repeats the last listed block (no new copy) and computes nothing;
  * dK/dV, grid (B, K, 1, P): `pair_codes`, the selected (key block, query block) pairs sorted
    by key block, one zero-writing step for a key block nobody selected, P = nk + nq * W: the
    steps follow the selected pairs, not nq * nk.
Every pair is PARTIAL (masked by segment, causality and key padding), as in the GPU kernels.
Both tables are flattened to 1-D for SMEM: 4 * B * K * (nq * (1 + W) + nk + nq * W) bytes,
about 280 KiB for B = 1, K = 8, T = 32K at 128-token blocks and W = 16.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from kernels_pallas import mosaic
from kernels_pallas.block_sparse_attention import pallas as sparse_pallas
from kernels_pallas.mosaic import PARTIAL, SKIP, Geometry


def pair_codes(sel_BxKxNqxNk, width: int):
    """The dK/dV walk's steps, [B, K, P] int32 codes kb * (nq + 1) + c, sorted: per key block kb
    the query blocks that selected it (c = query block + 1, ascending), or one c = 0 entry (a
    step that only writes zeros) if none did; the tail repeats the last key block with c = 0.
    P = nk + nq * min(width, nk) bounds the entries (each query block selects <= width blocks)."""
    B, K, nq, nk = sel_BxKxNqxNk.shape
    sel_t = sel_BxKxNqxNk.transpose(0, 1, 3, 2)  # [B, K, nk, nq]
    ext = jnp.concatenate([~sel_t.any(-1, keepdims=True), sel_t], axis=-1).reshape(B, K, -1)
    P = min(ext.shape[-1], nk + nq * min(width, nk))
    order, n = sparse_pallas.true_positions(ext, P)
    n = n[..., None]  # >= 1: every key block has an entry
    last = jnp.take_along_axis(order, n - 1, axis=-1)
    tail = last - last % (nq + 1)  # the last key block, c = 0
    return jnp.where(jnp.arange(P) < n, order, tail)


@dataclasses.dataclass(frozen=True)
class ListWalk:
    """Forward / dQ: each query block's list (table width 1 + fwd_steps). dK/dV: one run over
    `pair_codes` (bwd_steps of them) per (row, kv head)."""

    geo: Geometry
    kv_heads: int
    fwd_steps: int
    bwd_steps: int
    bwd_outer: int = 1
    fwd_tables = (0,)  # the per-query-block lists
    bwd_tables = (1,)  # the pair codes

    def fwd(self, t, b, kvh, qi, step):
        base = ((b * self.kv_heads + kvh) * self.geo.nq + qi) * (1 + self.fwd_steps)
        count = t[0][base]
        kb = t[0][base + 1 + jnp.minimum(step, jnp.maximum(count - 1, 0))]
        return kb, jnp.where(step < count, PARTIAL, SKIP)

    def bwd(self, t, b, kvh, outer, step):
        codes, width, P = t[1], self.geo.nq + 1, self.bwd_steps
        base = (b * self.kv_heads + kvh) * P
        code = codes[base + step]
        kb, c = lax.div(code, width), lax.rem(code, width)
        prev_kb = lax.div(codes[base + jnp.maximum(step - 1, 0)], width)
        next_kb = lax.div(codes[base + jnp.minimum(step + 1, P - 1)], width)
        first = (step == 0) | (prev_kb != kb)
        last = (step == P - 1) | (next_kb != kb)
        return kb, jnp.maximum(c - 1, 0), jnp.where(c > 0, PARTIAL, SKIP), first, last


def block_sparse_attention_mosaic(
    q, k, v, block_indices, block_counts, segment_ids, block_size: int, interpret: bool,
    tpu_interpreter: bool = True,
):
    """Arguments are assumed checked (see ops.block_sparse_attention); block_size must be a
    multiple of 128. interpret=True runs the kernels in the Pallas TPU interpreter
    (tpu_interpreter=False: the generic one, see mosaic._interpret)."""
    B, T, _, D = q.shape
    if block_size % mosaic.LANES:
        raise ValueError(
            f"{block_size=} must be a multiple of {mosaic.LANES} for the Mosaic (TPU) kernels"
        )
    geo = mosaic.make_geometry(T, D, block_size, block_size, True, interpret, tpu_interpreter)
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    idx, counts = lax.stop_gradient(block_indices), lax.stop_gradient(block_counts)
    M = idx.shape[-1]
    sel = sparse_pallas.selection(idx, counts, geo.nq)
    fwd_tab = sparse_pallas.compact(sel, min(M, geo.nq))
    codes = pair_codes(sel, M)
    walk = ListWalk(geo, k.shape[2], fwd_tab.shape[-1] - 1, codes.shape[-1])
    tables = (fwd_tab.reshape(-1), codes.reshape(-1))
    mosaic.check_smem(tables, f"block-sparse attention over T={T}, {block_size=}, "
                              f"max_blocks={M}")
    return mosaic.attention(q, k, v, lax.stop_gradient(seg), tables, geo, walk)
