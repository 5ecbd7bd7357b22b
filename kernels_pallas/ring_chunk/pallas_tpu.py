"""The ring's chunk op on TPU: the Mosaic kernels of `kernels_pallas/mosaic.py` with the chunk's
per-token mask and a walk over the chunk's own block table.

The mask is the chunk op's (ops.py): query i sees key j iff seg_q[i] == seg_k[j] and
pos_k[j] <= pos_q[i], so the kernels get ids and positions, each side padded to whole blocks
with fill ids that match nothing (tables.pad_ids). Which block pairs run is the Triton
kernels' table (`pallas._tables`: SKIP / FULL / PARTIAL per row and kv head from the
blocks' id and position ranges, SKIP where a block selection leaves a pair out or the round is
not `active`), passed whole to SMEM with its visit ranges: chunks are 1/ring-size of a
sequence, so [B, K, nq, nk] stays small at TPU block sizes (`mosaic.check_smem` says when not).

Forward: float32 out and lse of this chunk alone (out 0, lse NEG for a query that sees no key
here). Backward: float32 dq, dk, dv from the caller's global lse and delta, as `ops.py`
specifies. Blocks are multiples of 128 tokens (tables.make_chunk_blocks).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels_pallas import mosaic
from kernels_pallas.common import pad_axis
from kernels_pallas.ring_chunk import pallas as chunk_pallas
from kernels_pallas.ring_chunk.tables import SKIP, ChunkBlocks, visit_ranges
from kernels_pallas.mosaic import Geometry


@dataclasses.dataclass(frozen=True)
class TableWalk:
    """Per row and kv head (or per row, kv_heads = 1: one table for every head): query block
    qi visits key blocks [first, last) of its range, with the table's kind; key block kb's run
    visits query blocks [first, last) of its range. Tables: (kinds, the key-block ranges'
    firsts, their lasts, the query-block ranges' firsts, their lasts), each flat."""

    geo: Geometry
    kv_heads: int
    fwd_tables = (0, 1, 2)  # kinds, key-block ranges
    bwd_tables = (0, 3, 4)  # kinds, query-block ranges

    @property
    def fwd_steps(self) -> int:
        return self.geo.nk

    @property
    def bwd_outer(self) -> int:
        return self.geo.nk

    @property
    def bwd_steps(self) -> int:
        return self.geo.nq

    def _row(self, b, kvh):
        return b * self.kv_heads + (kvh if self.kv_heads > 1 else 0)

    def _kind(self, kinds, b, kvh, qi, kb):
        return kinds[(self._row(b, kvh) * self.geo.nq + qi) * self.geo.nk + kb]

    def _key_range(self, t, b, kvh, qi):
        """(first, last) of the key blocks query block qi visits."""
        r = self._row(b, kvh) * self.geo.nq + qi
        return t[1][r], t[2][r]

    def fwd_block(self, t, b, kvh, qi, step):
        return mosaic.range_block(*self._key_range(t, b, kvh, qi), step)

    def fwd(self, t, b, kvh, qi, step):
        first, last = self._key_range(t, b, kvh, qi)
        kb = mosaic.range_block(first, last, step)
        return kb, jnp.where(first + step < last, self._kind(t[0], b, kvh, qi, kb), SKIP)

    def bwd(self, t, b, kvh, kb, step):
        r = self._row(b, kvh) * self.geo.nk + kb
        first, last = t[3][r], t[4][r]
        qi = mosaic.range_block(first, last, step)
        kind = jnp.where(first + step < last, self._kind(t[0], b, kvh, qi, kb), SKIP)
        return kb, qi, kind, step == 0, step == self.bwd_steps - 1


def _setup(q, k, seg_q, pos_q, seg_k, pos_k, active, blocks: ChunkBlocks, select):
    """(geometry, walk, SMEM tables, ids (seg_q, seg_k, pos_q, pos_k) padded to blocks)."""
    # Interpreted, the generic Pallas interpreter: the ring runs the chunk under shard_map on
    # several devices, where the TPU interpreter (which simulates devices itself) stalls.
    geo = mosaic.make_geometry(blocks.Lq, blocks.D, blocks.bq, blocks.bk, False,
                               blocks.interpret, tpu_interpreter=False, T_kv=blocks.Lk,
                               positions=True)
    (sq, pq, sk, pk), kinds = chunk_pallas._tables(seg_q, pos_q, seg_k, pos_k, active, blocks,
                                                   k.shape[2], select)
    if select is None:  # the same table for every kv head: keep one
        kinds = kinds[:, :1]
    k_range, q_range = visit_ranges(kinds), visit_ranges(kinds.swapaxes(-1, -2))
    tables = (kinds.reshape(-1), *(r[..., i].reshape(-1) for r in (k_range, q_range)
                                   for i in (0, 1)))
    mosaic.check_smem(tables, f"ring chunk {blocks.Lq}x{blocks.Lk} with blocks "
                              f"{blocks.bq}x{blocks.bk}")
    return geo, TableWalk(geo, kinds.shape[1]), tables, (sq, sk, pq, pk)


def _layouts(q, k, v, geo: Geometry):
    return (mosaic.layout(q, geo.Tq, geo), mosaic.layout(k, geo.Tk, geo),
            mosaic.layout(v, geo.Tk, geo))


def chunk_forward_mosaic(q, k, v, seg_q, pos_q, seg_k, pos_k, active, blocks: ChunkBlocks,
                         select=None, out_dtype=jnp.float32):
    """out [B, Lq, H, D] in out_dtype and lse float32 [B, Lq, H] of one chunk pair (only the
    block pairs `select` [B, K, nq, nk] keeps, if given)."""
    geo, walk, tables, ids = _setup(q, k, seg_q, pos_q, seg_k, pos_k, active, blocks, select)
    o, lse = mosaic.forward(tables, ids, *_layouts(q, k, v, geo), geo, walk,
                            out_dtype=out_dtype)
    return mosaic.unlayout(o, geo, out_dtype), lse[:, :, : blocks.Lq].transpose(0, 2, 1)


def chunk_backward_mosaic(q, k, v, seg_q, pos_q, seg_k, pos_k, do, lse, delta, active,
                          blocks: ChunkBlocks, select=None, grad_dtype=jnp.float32, out=None):
    """dq [B, Lq, H, D], dk and dv [B, Lk, K, D] in grad_dtype of one chunk pair, given the global
    lse and delta = rowsum(dO * O) [B, Lq, H] of the queries (`select` as in the forward;
    `out` as tables.output_delta says, its row sum taken by the dQ kernel)."""
    geo, walk, tables, ids = _setup(q, k, seg_q, pos_q, seg_k, pos_k, active, blocks, select)

    def rows(x_BxLxH):  # [B, Lq, H] -> float32 [B, H, Tq]
        return pad_axis(x_BxLxH.astype(jnp.float32), 1, geo.Tq).transpose(0, 2, 1)

    o_t = None if out is None else mosaic.layout(out, geo.Tq, geo)
    dq, dk, dv = mosaic.backward(tables, ids, *_layouts(q, k, v, geo),
                                 mosaic.layout(do, geo.Tq, geo), rows(lse), geo, walk,
                                 grad_dtype=grad_dtype, o_t=o_t, delta=rows(delta))
    return (mosaic.unlayout(dq, geo, grad_dtype),
            mosaic.unlayout(dk, geo, grad_dtype, blocks.Lk),
            mosaic.unlayout(dv, geo, grad_dtype, blocks.Lk))

