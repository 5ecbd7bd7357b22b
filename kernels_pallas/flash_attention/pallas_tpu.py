"""Flash attention on TPU: the Mosaic kernels of `kernels_pallas/mosaic.py` with a walk over
contiguous key-block ranges (`mosaic.attention` holds the `jax.custom_vjp`).

Which pairs are visited is the rule of `pallas.block_tables` (the same as the GPU kernels and
`xla.block_kinds`): query block i visits the key blocks [first, last) that are not SKIP, and key
block j is visited by the query blocks [first, last). Mosaic reads tables from SMEM, which is
small, so instead of the [B, nq, nk] table of kinds the kernels get, per block, six int32s:
(lowest nonzero segment id, highest nonzero id, holds padding, the id if the block holds one id
only else NOT_UNIFORM, first, last), each field its own flat [B * n] array (SMEM pads the last
dimension of 2-D arrays). Separate arrays, not one stacked table: stacking compiled a
concatenate, a transpose and a copy per side, and a forward-only program then leaves out the
key blocks' (first, last), which only the backward reads, and the ops that compute them
(flash forward, T = 4096, D = 64, bf16, TPU v6e: 0.47 -> 0.46 s). `pair_kind` rebuilds
a pair's kind from the two blocks' summaries with scalar arithmetic inside the kernel; tests
check it against `block_tables` pair by pair.

Padding as on GPU: T is padded to whole blocks; padded queries copy the last segment id (their
outputs are sliced off, their cotangent is zero) and padded keys are masked by position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas import mosaic
from kernels_pallas.common import pad_axis
from kernels_pallas.flash_attention import pallas as flash_pallas
from kernels_pallas.mosaic import FULL, PARTIAL, SKIP, Geometry

NOT_UNIFORM = jnp.iinfo(jnp.int32).min
FIELDS = 6  # per side: lo, hi, has_padding, uniform id, first, last


def pair_kind(q_summary, k_summary, qi, kb, geo: Geometry):
    """SKIP / FULL / PARTIAL of (query block qi, key block kb) from the blocks' (lo, hi,
    has_padding, uniform id) summaries; works on scalars (in a kernel) and on arrays."""
    qlo, qhi, q0, qu = q_summary
    klo, khi, k0, ku = k_summary
    overlap = (jnp.maximum(qlo, klo) <= jnp.minimum(qhi, khi)) | ((q0 != 0) & (k0 != 0))
    full = (qu == ku) & (qu != NOT_UNIFORM)
    if geo.causal:
        full = full & ((kb + 1) * geo.bk - 1 <= qi * geo.bq)
    if geo.Tk > geo.T:
        full = full & (kb != geo.nk - 1)
    return jnp.where(overlap, jnp.where(full, FULL, PARTIAL), SKIP)


def _fields(seg_BxT, block: int, ranges_BxNx2):
    """The FIELDS of one side's blocks (see the module doc), each flat [B * n] int32."""
    lo, hi, pad, mn, mx = flash_pallas.block_summary(seg_BxT, block)
    uniform = jnp.where(mn == mx, mn, NOT_UNIFORM)
    fields = (lo, hi, pad, uniform, ranges_BxNx2[..., 0], ranges_BxNx2[..., 1])
    return tuple(f.astype(jnp.int32).reshape(-1) for f in fields)


def tables(seg_BxT, geo: Geometry):
    """The query blocks' FIELDS, then the key blocks': 2 * FIELDS flat [B * n] int32 arrays
    (first, last: the key blocks a query block visits, the query blocks a key block visits)."""
    seg_q = pad_axis(seg_BxT, 1, geo.Tq, mode="edge")
    seg_k = pad_axis(seg_BxT, 1, geo.Tk, mode="edge")
    _, k_range, q_range = flash_pallas.block_tables(seg_q, seg_k, geo)
    return _fields(seg_q, geo.bq, k_range) + _fields(seg_k, geo.bk, q_range)


def _summary(fields, row):
    """(lo, hi, has_padding, uniform id) of one block: fields are one side's FIELDS refs, row
    the block's index into them (b * n + block)."""
    return tuple(f[row] for f in fields[:4])


def _range(fields, row):
    """(first, last) of one block's visit range (fields, row as in `_summary`)."""
    return fields[4][row], fields[5][row]


@dataclasses.dataclass(frozen=True)
class RangeWalk:
    """Contiguous ranges: step s of query block i is key block first + s while below last."""

    geo: Geometry
    fwd_tables = (*range(FIELDS), *range(FIELDS, FIELDS + 4))  # not the key blocks' ranges
    bwd_tables = (*range(4), *range(FIELDS, 2 * FIELDS))  # not the query blocks' ranges

    @property
    def fwd_steps(self) -> int:
        return self.geo.nk

    @property
    def bwd_outer(self) -> int:  # one run of steps per key block
        return self.geo.nk

    @property
    def bwd_steps(self) -> int:
        return self.geo.nq

    def fwd_block(self, t, b, kvh, qi, step):
        return mosaic.range_block(*_range(t[:FIELDS], b * self.geo.nq + qi), step)

    def fwd(self, t, b, kvh, qi, step):
        qtab, ktab = t[:FIELDS], t[FIELDS:]
        first, last = _range(qtab, b * self.geo.nq + qi)
        kb = mosaic.range_block(first, last, step)
        kind = pair_kind(_summary(qtab, b * self.geo.nq + qi),
                         _summary(ktab, b * self.geo.nk + kb), qi, kb, self.geo)
        return kb, jnp.where(first + step < last, kind, SKIP)

    def bwd(self, t, b, kvh, kb, step):
        """Key block kb's run: the query blocks [first, last), then SKIP to the grid's end."""
        qtab, ktab = t[:FIELDS], t[FIELDS:]
        first, last = _range(ktab, b * self.geo.nk + kb)
        qi = mosaic.range_block(first, last, step)
        kind = pair_kind(_summary(qtab, b * self.geo.nq + qi),
                         _summary(ktab, b * self.geo.nk + kb), qi, kb, self.geo)
        kind = jnp.where(first + step < last, kind, SKIP)
        return kb, qi, kind, step == 0, step == self.bwd_steps - 1


def flash_attention_mosaic(
    q, k, v, segment_ids, causal: bool, block_q: int, block_k: int, interpret: bool,
    tpu_interpreter: bool = True,
):
    """Flash attention through the Mosaic (TPU) kernels; arguments are assumed checked (see
    ops.flash_attention). interpret=True runs them in the Pallas TPU interpreter (any backend;
    tpu_interpreter=False: the generic one, see mosaic._interpret)."""
    B, T, _, D = q.shape
    geo = mosaic.make_geometry(T, D, block_q, block_k, causal, interpret, tpu_interpreter)
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    seg = jax.lax.stop_gradient(seg)
    tabs = tables(seg, geo)
    mosaic.check_smem(tabs, f"flash attention over B={B}, T={T} with blocks {geo.bq}x{geo.bk}")
    return mosaic.attention(q, k, v, seg, tabs, geo, RangeWalk(geo))
