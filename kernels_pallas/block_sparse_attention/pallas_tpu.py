"""Block-sparse attention on TPU: the Mosaic kernels of `kernels_pallas/mosaic.py` with a walk
over explicit block lists (`mosaic.attention` holds the `jax.custom_vjp`).

The lists are `pallas.block_tables`' (the GPU kernels' own, so both backends select the same
pairs): fwd [B, K, nq, 1 + W] (count, then the selected key blocks ascending) and bwd
[B, K, nk, 1 + nq] (count, then the query blocks that selected the key block), flattened to
1-D for SMEM. Step s of a query block is its s-th listed key block while s < count; past the
count the walk repeats the last listed block with kind SKIP, so the pipeline copies nothing new
and no arithmetic runs: both follow the counts. Every listed pair is PARTIAL (masked by segment,
causality and key padding), as in the GPU kernels.

SMEM holds both tables: 4 * B * K * nq * (2 + W + nk) bytes (about 0.5 MiB for B = 1, K = 8,
T = 32K at 128-token blocks and W = 16); longer rows want larger blocks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from kernels_pallas import mosaic
from kernels_pallas.block_sparse_attention import pallas as sparse_pallas
from kernels_pallas.mosaic import PARTIAL, SKIP, Geometry


@dataclasses.dataclass(frozen=True)
class ListWalk:
    """Explicit lists: fwd table width 1 + fwd_steps, bwd table width 1 + bwd_steps."""

    geo: Geometry
    kv_heads: int
    fwd_steps: int

    @property
    def bwd_steps(self) -> int:
        return self.geo.nk

    def _entry(self, tab, width, b, kvh, block, n_blocks, step):
        base = ((b * self.kv_heads + kvh) * n_blocks + block) * (1 + width)
        count = tab[base]
        other = tab[base + 1 + jnp.minimum(step, jnp.maximum(count - 1, 0))]
        return other, jnp.where(step < count, PARTIAL, SKIP)

    def fwd(self, t, b, kvh, qi, step):
        return self._entry(t[0], self.fwd_steps, b, kvh, qi, self.geo.nq, step)

    def bwd(self, t, b, kvh, kb, step):
        return self._entry(t[1], self.bwd_steps, b, kvh, kb, self.geo.nk, step)


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
    fwd_tab, bwd_tab = sparse_pallas.block_tables(
        lax.stop_gradient(block_indices), lax.stop_gradient(block_counts), geo.nq
    )
    walk = ListWalk(geo, k.shape[2], fwd_tab.shape[-1] - 1)
    tables = (fwd_tab.reshape(-1), bwd_tab.reshape(-1))
    return mosaic.attention(q, k, v, lax.stop_gradient(seg), tables, geo, walk)
