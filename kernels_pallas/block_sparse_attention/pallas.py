"""Pallas block-sparse attention: forward, dQ and dK/dV kernels behind a `jax.custom_vjp`.

Host metadata + kernel. Before any kernel runs, `block_tables` (plain JAX) turns the user's
lists into two clean tables built from one selection matrix sel[b, k, i, j] ("query block i of
kv head k sees key block j"): an entry counts only if its slot is below the count, it lies in
[0, nq) and it is not above the diagonal (j <= i; a later key block selects nothing under the
causal mask). Repeats collapse in `sel` by construction, so duplicates count once.
  * fwd table [B, K, nq, 1 + M]: column 0 the count, then the selected key blocks ascending;
  * bwd table [B, K, nk, 1 + nq]: column 0 the count, then the query blocks that selected key
    block j, ascending (the transpose of sel, so dK/dV is gathered per key block with no
    scatter and no atomics).
The order is fixed (ascending) whatever order the user gave, so results do not depend on it.

Three `pl.pallas_call`s, matmuls in the input dtype accumulating in float32 (as the flash
kernels: flash_attention/pallas.py), all other arithmetic float32:
  * forward, grid (B, H, Tp / tile): program (b, h, t) holds query tile t of query block
    i = t // nsub, reads kv head h // G and loops `fori_loop(0, count)` over block i's table
    row (a data-dependent trip count: work follows the counts), slicing each selected key
    block out of the whole-row k/v with pl.ds, tile by tile; causal + same-segment +
    key-padding mask; online softmax; writes the output and the log-sum-exp (lse);
  * dQ, grid (B, H, Tp / tile): the same walk, recomputes p = exp(s - lse), accumulates dQ;
  * dK/dV, grid (B, K, Tp / tile): one key tile per program; loops over the G query heads
    sharing the kv head and over the query blocks in its block's bwd table row, tile by tile.
delta = rowsum(dO * O) is done in jnp before the backward kernels.

Tiles: a routing block of bs tokens is one tile (nsub = 1: no inner loop) unless its q / k tile
would exceed MAX_TILE_BYTES (float32 overflows a GPU's shared memory, large bf16 tiles compile
slowly); then it is split into nsub = bs / tile tiles (`sub_tile`), the routing unchanged. On the diagonal block the wholly masked tiles are
skipped: key tiles after the query tile's own (forward, dQ), query tiles before the key tile's
own (dK/dV).

Layout inside (as in flash_attention/pallas.py): q/o [B, Tp, H, Dp], k/v [B, Tp, K, Dp] (the
caller's layout, padded only: common.triton_layout), lse and delta [B, H, Tp], Dp = D
padded to a power of two >= 16 (Triton wants power-of-two loads and dots >= 16), zeros in the
padded columns. T is padded to Tp = nq * block_size; padded queries copy the last segment id
(their outputs are sliced off, their cotangent is zero); padded keys are masked by position.
Tables are read with scalar loads from BlockSpec'd rows (the Triton lowering has no scalar
prefetch), so their row lengths need not be powers of two.

A row that sees nothing keeps l = 0: its output is 0 and its lse is NEG; in the backward
every one of its probabilities is masked (`where`, never a product), so its gradients are 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common import NEG, NN as _NN, NT as _NT, TN as _TN, triton_dot as _mm
from kernels_pallas.common import backward_tile, next_pow2 as _next_pow2, pad_axis, triton_compiler_params
from kernels_pallas.common import group_block, head_block, kv_group_rows, kv_groups, row_delta
from kernels_pallas.common import triton_layout, triton_unlayout



@dataclasses.dataclass(frozen=True)
class SparseTritonBlocks:
    """Static blocking of one call (hashable: a nondiff argument of the custom_vjp)."""

    T: int
    D: int
    bs: int
    interpret: bool
    tile: int  # rows of the kernels' q / k tiles: bs, or a divisor of it (sub_tile)

    @property
    def nb(self) -> int:
        return -(-self.T // self.bs)

    @property
    def nsub(self) -> int:
        """Tiles per routing block."""
        return self.bs // self.tile

    @property
    def Tp(self) -> int:
        return self.nb * self.bs

    @property
    def Dp(self) -> int:
        return max(16, _next_pow2(self.D))

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.D)


# Bytes of a q / k tile at most (rows x padded head dim x itemsize). Triton stages float32
# (3xTF32) dot operands in shared memory at about twice the bytes of bf16: a 128 x 128 float32
# tile asks for 394 KB on H100 (227 KB there, 163 KB on A100) and 64 x 128 still 262 KB in the
# backward, while 64 x 64 and 32 x 128 fit on both (scripts/compile_kernels.py). A bf16 block of
# 128 x 128 fits, but compiled 1.5x slower than as two 64-row tiles (fwd + bwd, T = 4096, H100:
# 1.19 s against 0.79 s; JAX's own Triton attention: 0.59 s).
MAX_TILE_BYTES = 64 * 64 * 4


def sub_tile(block_size: int, itemsize: int, Dp: int) -> int:
    """The kernels' tile rows for a routing block of head dim Dp: the largest power-of-two
    divisor of the block whose q / k tile is within MAX_TILE_BYTES, at least 16 rows (Triton's
    smallest dot)."""
    tile = block_size
    while tile % 2 == 0 and tile // 2 >= 16 and tile * Dp * itemsize > MAX_TILE_BYTES:
        tile //= 2
    return tile


def make_sparse_triton_blocks(T: int, D: int, block_size: int, interpret: bool,
                              tile: int | None = None) -> SparseTritonBlocks:
    """block_size is part of the semantics (it defines the blocks), so it is never changed;
    `tile` (default: the whole block) only splits the kernels' work and must divide it."""
    if not interpret and (block_size & (block_size - 1) or block_size < 16):
        raise ValueError(
            f"{block_size=} must be a power of two >= 16 for compiled Pallas (T={T})"
        )
    tile = block_size if tile is None else int(tile)
    if tile < 1 or block_size % tile or (not interpret and tile < 16):
        raise ValueError(f"{tile=} must divide {block_size=} (and be >= 16 for compiled Pallas)")
    return SparseTritonBlocks(int(T), int(D), int(block_size), bool(interpret), tile)


# ----------------------------------------------------------------------------- host metadata


def selection(block_indices, block_counts, nb: int):
    """[B, K, nq, nk] bool: valid slot, index in [0, nk), and key block <= query block.
    A compare-and-reduce over the slots, not a scatter: XLA fuses it into one pass, and the
    scatter took 0.23 s of a TPU compile against 0.06 s."""
    B, K, nq, M = block_indices.shape
    idx = block_indices.astype(jnp.int32)
    valid = jnp.arange(M) < jnp.clip(block_counts.astype(jnp.int32), 0, M)[..., None]
    valid = valid & (idx >= 0) & (idx <= jnp.arange(nq)[:, None])
    return (valid[..., None] & (idx[..., None] == jnp.arange(nb))).any(-2)


def true_positions(mask, width: int):
    """(the positions of the first `width` True entries along the last axis, ascending, int32
    [..., width] (the length of the axis past the last True), the count of True [...]).

    By a binary search in the running count, not a sort: sorting made most of the TPU compile
    time of the block tables (1.2 s for pair_codes at T = 4096 against 0.3 s). Small tables
    compare every entry with every rank instead (fewer ops to compile)."""
    cs = jnp.cumsum(mask, axis=-1, dtype=jnp.int32)
    ranks = jnp.arange(1, width + 1, dtype=jnp.int32)
    method = "compare_all" if width * mask.shape[-1] <= 1 << 16 else "scan"
    find = jax.vmap(lambda c: jnp.searchsorted(c, ranks, side="left", method=method))
    pos = find(cs.reshape(-1, cs.shape[-1])).reshape(*cs.shape[:-1], width)
    return pos.astype(jnp.int32), cs[..., -1]


def compact(sel_BxKxNxM, width: int):
    """[..., 1 + width] int32: count of True, then the True positions ascending (then filler)."""
    order, count = true_positions(sel_BxKxNxM, width)
    order = jnp.where(jnp.arange(width) < count[..., None], order, 0)
    return jnp.concatenate([count[..., None], order], axis=-1)


def block_tables(block_indices, block_counts, nb: int):
    """fwd [B, K, nq, 1 + M] and bwd [B, K, nk, 1 + nq] tables (see the module doc)."""
    M = block_indices.shape[-1]
    sel = selection(block_indices, block_counts, nb)
    return compact(sel, min(M, nb)), compact(sel.transpose(0, 1, 3, 2), nb)


# ----------------------------------------------------------------------------- kernels


def _mask(sq, sk, q_start, k_start, blocks: SparseTritonBlocks):
    """[tile, tile] bool: same segment, causal, key not padding."""
    shape = (blocks.tile, blocks.tile)
    qpos = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
    kpos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = (sq[:, None] == sk[None, :]) & (kpos <= qpos)
    if blocks.Tp > blocks.T:
        # Redundant for real queries (padded keys follow every one of them, so causality
        # removes them) and padded query rows get a zero cotangent; kept so no row of the
        # kernel ever mixes in padding, whatever the caller does with those rows.
        mask = mask & (kpos < blocks.T)
    return mask


def _tiles(fn, carry, base, lo, hi, blocks: SparseTritonBlocks):
    """fn(start, carry) over the tiles lo..hi-1 of the routing block at row `base` (start = base +
    u * tile); a block of one tile is one call, with no loop."""
    if blocks.nsub == 1:
        return fn(base, carry)
    return lax.fori_loop(lo, hi, lambda u, c: fn(base + u * blocks.tile, c), carry)


def _walk_key_tiles(tab_ref, key_tile, init, blocks: SparseTritonBlocks):
    """key_tile(k_start, carry) over every key block in the table row of this program's query
    tile t (tile a = t % nsub of query block i = t // nsub), tile by tile; on the diagonal
    block only the key tiles up to the query tile's own (the later ones are all masked)."""
    t = pl.program_id(2)
    i, a = t // blocks.nsub, t % blocks.nsub

    def body(s, carry):
        j = tab_ref[1 + s]
        return _tiles(key_tile, carry, j * blocks.bs, 0, jnp.where(j == i, a + 1, blocks.nsub), blocks)

    return lax.fori_loop(0, tab_ref[0], body, init)


def _fwd_kernel(tab_ref, sq_ref, sk_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                blocks: SparseTritonBlocks):
    tile, Dp = blocks.tile, blocks.Dp
    t = pl.program_id(2)  # the query tile
    q = q_ref[...]  # [tile, Dp]
    sq = sq_ref[...]

    def key_tile(k_start, carry):
        m, l, acc = carry
        k_slice = pl.ds(pl.multiple_of(k_start, tile), tile)
        k = k_ref[k_slice, :]
        v = v_ref[k_slice, :]
        mask = _mask(sq, sk_ref[k_slice], t * tile, k_start, blocks)
        sc = jnp.where(mask, _mm(q, k, _NT, blocks.interpret) * blocks.scale, NEG)
        m_new = jnp.maximum(m, sc.max(-1))
        p = jnp.where(mask, jnp.exp(sc - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        acc = alpha[:, None] * acc + _mm(p.astype(v.dtype), v, _NN, blocks.interpret)
        return m_new, l, acc

    init = (
        jnp.full((tile,), NEG, jnp.float32),
        jnp.zeros((tile,), jnp.float32),
        jnp.zeros((tile, Dp), jnp.float32),
    )
    m, l, acc = _walk_key_tiles(tab_ref, key_tile, init, blocks)
    l = jnp.where(l == 0.0, 1.0, l)  # a row that sees nothing: acc = 0, output 0
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(tab_ref, sq_ref, sk_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, blocks: SparseTritonBlocks):
    tile, Dp = blocks.tile, blocks.Dp
    t = pl.program_id(2)  # the query tile
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    sq = sq_ref[...]

    def key_tile(k_start, dq):
        k_slice = pl.ds(pl.multiple_of(k_start, tile), tile)
        k = k_ref[k_slice, :]
        v = v_ref[k_slice, :]
        mask = _mask(sq, sk_ref[k_slice], t * tile, k_start, blocks)
        p = jnp.where(mask, jnp.exp(_mm(q, k, _NT, blocks.interpret) * blocks.scale - lse[:, None]), 0.0)
        ds = p * (_mm(do, v, _NT, blocks.interpret) - delta[:, None])
        return dq + _mm(ds.astype(k.dtype), k, _NN, blocks.interpret)

    dq = _walk_key_tiles(tab_ref, key_tile, jnp.zeros((tile, Dp), jnp.float32), blocks)
    dq_ref[...] = (dq * blocks.scale).astype(dq_ref.dtype)


def _dkv_kernel(tab_ref, sq_ref, sk_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, blocks: SparseTritonBlocks, G: int):
    tile, Dp, nsub = blocks.tile, blocks.Dp, blocks.nsub
    t = pl.program_id(2)  # key tile t: tile u = t % nsub of key block j = t // nsub
    j, u = t // nsub, t % nsub
    k = k_ref[...]  # [tile, Dp]
    v = v_ref[...]
    sk = sk_ref[...]
    n = tab_ref[0]

    def per_head(g, carry):
        def query_tile(q_start, carry):
            dk, dv = carry
            q_slice = pl.ds(pl.multiple_of(q_start, tile), tile)
            q = q_ref[q_slice, g, :]
            do = do_ref[q_slice, g, :]
            mask = _mask(sq_ref[q_slice], sk, q_start, t * tile, blocks)
            s = _mm(q, k, _NT, blocks.interpret) * blocks.scale
            p = jnp.where(mask, jnp.exp(s - lse_ref[g, q_slice][:, None]), 0.0)
            dv = dv + _mm(p.astype(do.dtype), do, _TN, blocks.interpret)
            ds = p * (_mm(do, v, _NT, blocks.interpret) - delta_ref[g, q_slice][:, None])
            dk = dk + _mm(ds.astype(q.dtype), q, _TN, blocks.interpret)  # the scale is applied once, at the end
            return dk, dv

        def body(r, carry):
            i = tab_ref[1 + r]  # on the diagonal block, query tiles before the key's own see none of it
            return _tiles(query_tile, carry, i * blocks.bs, jnp.where(i == j, u, 0), nsub, blocks)

        return lax.fori_loop(0, n, body, carry)

    zeros = jnp.zeros((tile, Dp), jnp.float32)
    dk, dv = lax.fori_loop(0, G, per_head, (zeros, zeros))
    dk_ref[...] = (dk * blocks.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas_calls


def _layout(x_BxTxNxD, blocks: SparseTritonBlocks):
    """[B, T, N, D] -> [B, Tp, N, Dp] (common.triton_layout: zero padding), dtype kept."""
    return triton_layout(x_BxTxNxD, blocks.Tp, blocks.Dp)


def _unlayout(x_BxTpxNxDp, blocks: SparseTritonBlocks, dtype):
    return triton_unlayout(x_BxTpxNxDp, blocks.T, blocks.D, dtype)


def _forward(q, k, v, seg, fwd_tab, blocks: SparseTritonBlocks):
    B, _, H, _ = q.shape
    G = H // k.shape[2]
    tile, nsub, Dp, Tp = blocks.tile, blocks.nsub, blocks.Dp, blocks.Tp
    W = fwd_tab.shape[-1]
    seg_p = pad_axis(seg, 1, Tp, mode="edge")
    return pl.pallas_call(
        functools.partial(_fwd_kernel, blocks=blocks),
        grid=(B, H, Tp // tile),  # one program per query tile t (of routing block t // nsub)
        in_specs=[
            pl.BlockSpec((None, None, None, W), lambda b, h, t: (b, h // G, t // nsub, 0)),  # table row
            pl.BlockSpec((None, tile), lambda b, h, t: (b, t)),  # query segment ids
            pl.BlockSpec((None, Tp), lambda b, h, t: (b, 0)),  # key segment ids (whole row)
            head_block(tile, Dp, lambda b, h, t: (b, t, h)),  # q tile
            head_block(Tp, Dp, lambda b, h, t: (b, 0, h // G)),  # k row
            head_block(Tp, Dp, lambda b, h, t: (b, 0, h // G)),  # v row
        ],
        out_specs=[
            head_block(tile, Dp, lambda b, h, t: (b, t, h)),
            pl.BlockSpec((None, None, tile), lambda b, h, t: (b, h, t)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tp, H, Dp), q.dtype),
            jax.ShapeDtypeStruct((B, H, Tp), jnp.float32),
        ],
        interpret=blocks.interpret,
        compiler_params=triton_compiler_params(blocks.interpret, blocks.tile ** 2),
        name="block_sparse_attention_fwd",
    )(fwd_tab, seg_p, seg_p, _layout(q, blocks), _layout(k, blocks), _layout(v, blocks))


def _backward(fwd_blocks: SparseTritonBlocks, res, do):
    q, k, v, seg, fwd_tab, bwd_tab, o, lse = res
    B, _, H, _ = q.shape
    K = k.shape[2]
    G = H // K
    # the routing blocks (and so Tp and the tables) are the forward's; the tiles the backward's
    blocks = dataclasses.replace(fwd_blocks, tile=backward_tile(fwd_blocks.tile))
    tile, nsub, Dp, Tp = blocks.tile, blocks.nsub, blocks.Dp, blocks.Tp
    seg_p = pad_axis(seg, 1, Tp, mode="edge")
    qt, kt, vt = _layout(q, blocks), _layout(k, blocks), _layout(v, blocks)
    dot = _layout(do, blocks)  # padded rows and columns get a zero cotangent
    delta = row_delta(dot, o)  # [B, H, Tp]
    W = fwd_tab.shape[-1]

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, blocks=blocks),
        grid=(B, H, Tp // tile),
        in_specs=[
            pl.BlockSpec((None, None, None, W), lambda b, h, t: (b, h // G, t // nsub, 0)),
            pl.BlockSpec((None, tile), lambda b, h, t: (b, t)),
            pl.BlockSpec((None, Tp), lambda b, h, t: (b, 0)),
            head_block(tile, Dp, lambda b, h, t: (b, t, h)),  # q
            head_block(Tp, Dp, lambda b, h, t: (b, 0, h // G)),  # k
            head_block(Tp, Dp, lambda b, h, t: (b, 0, h // G)),  # v
            head_block(tile, Dp, lambda b, h, t: (b, t, h)),  # do
            pl.BlockSpec((None, None, tile), lambda b, h, t: (b, h, t)),  # lse
            pl.BlockSpec((None, None, tile), lambda b, h, t: (b, h, t)),  # delta
        ],
        out_specs=head_block(tile, Dp, lambda b, h, t: (b, t, h)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, Dp), q.dtype),
        interpret=blocks.interpret,
        compiler_params=triton_compiler_params(blocks.interpret, blocks.tile ** 2),
        name="block_sparse_attention_dq",
    )(fwd_tab, seg_p, seg_p, qt, kt, vt, dot, lse, delta)

    # Query-side arrays per kv head: common.kv_groups / kv_group_rows (free reshapes).
    Wb = bwd_tab.shape[-1]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, blocks=blocks, G=G),
        grid=(B, K, Tp // tile),  # one program per key tile t (of routing block t // nsub)
        in_specs=[
            pl.BlockSpec((None, None, None, Wb), lambda b, h, t: (b, h, t // nsub, 0)),  # table row
            pl.BlockSpec((None, Tp), lambda b, h, t: (b, 0)),  # query segment ids (row)
            pl.BlockSpec((None, tile), lambda b, h, t: (b, t)),  # key segment ids (tile)
            group_block(Tp, G, Dp, lambda b, h, t: (b, h)),  # q
            head_block(tile, Dp, lambda b, h, t: (b, t, h)),  # k
            head_block(tile, Dp, lambda b, h, t: (b, t, h)),  # v
            group_block(Tp, G, Dp, lambda b, h, t: (b, h)),  # do
            pl.BlockSpec((None, None, G, Tp), lambda b, h, t: (b, h, 0, 0)),  # lse
            pl.BlockSpec((None, None, G, Tp), lambda b, h, t: (b, h, 0, 0)),  # delta
        ],
        out_specs=[
            head_block(tile, Dp, lambda b, h, t: (b, t, h)),
            head_block(tile, Dp, lambda b, h, t: (b, t, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tp, K, Dp), k.dtype),
            jax.ShapeDtypeStruct((B, Tp, K, Dp), v.dtype),
        ],
        interpret=blocks.interpret,
        compiler_params=triton_compiler_params(blocks.interpret, blocks.tile ** 2),
        name="block_sparse_attention_dkv",
    )(bwd_tab, seg_p, seg_p, kv_groups(qt, K), kt, vt, kv_groups(dot, K), kv_group_rows(lse, K),
      kv_group_rows(delta, K))
    return (
        _unlayout(dq, blocks, q.dtype),
        _unlayout(dk, blocks, k.dtype),
        _unlayout(dv, blocks, v.dtype),
        None,
        None,
        None,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _sparse(q, k, v, seg, fwd_tab, bwd_tab, blocks):
    return _unlayout(_forward(q, k, v, seg, fwd_tab, blocks)[0], blocks, q.dtype)


def _sparse_fwd(q, k, v, seg, fwd_tab, bwd_tab, blocks):
    o, lse = _forward(q, k, v, seg, fwd_tab, blocks)
    return _unlayout(o, blocks, q.dtype), (q, k, v, seg, fwd_tab, bwd_tab, o, lse)


_sparse.defvjp(_sparse_fwd, _backward)


def block_sparse_attention_pallas(
    q, k, v, block_indices, block_counts, segment_ids, block_size: int, interpret: bool,
    tile: int | None = None,
):
    """Arguments are assumed checked (see ops.block_sparse_attention).

    interpret=True runs the kernels in the Pallas interpreter (any backend, e.g. CPU tests).
    tile: the kernels' tile rows (default sub_tile: the whole block, split within
    MAX_TILE_BYTES); the result does not depend on it beyond rounding (the
    online softmax adds the tiles in another grouping).
    """
    B, T, _, D = q.shape
    if tile is None:
        tile = sub_tile(block_size, jnp.dtype(q.dtype).itemsize, max(16, _next_pow2(D)))
    blocks = make_sparse_triton_blocks(T, D, block_size, interpret, tile)
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    idx = lax.stop_gradient(block_indices)
    counts = lax.stop_gradient(block_counts)
    fwd_tab, bwd_tab = block_tables(idx, counts, blocks.nb)
    return _sparse(q, k, v, seg, fwd_tab, bwd_tab, blocks)
