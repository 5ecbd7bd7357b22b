"""Public entry point: `block_sparse_attention` checks its arguments and dispatches.

implementation:
  "xla"       gather attention over groups of query blocks sorted by count, with a
              recomputing custom_vjp (xla.py); its work follows each query block's own count
              (up to the spread inside a group), not max(block_counts) nor the list length;
  "pallas"    Pallas kernels: forward / dQ / dK,dV, each program's loop follows its own block
              count: pallas.py (Triton) on GPU and in the CPU interpreter, pallas_tpu.py
              (Mosaic; block_size a multiple of 128) on TPU;
  "reference" the dense jnp oracle (reference.py), O(T^2) memory;
  "auto"      "pallas" when jax.default_backend() is in common.AUTO_PALLAS_BACKENDS ("gpu"), else "xla".

interpret (Pallas only): None = run the kernels in the Pallas interpreter iff the backend is
CPU (slow; for tests); True / False force it. Compiled Pallas on CPU does not exist.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.block_sparse_attention.pallas import block_sparse_attention_pallas
from kernels_pallas.block_sparse_attention.pallas_tpu import block_sparse_attention_mosaic
from kernels_pallas.common import check_qkv, pallas_target, resolve_implementation
from kernels_pallas.block_sparse_attention.reference import block_sparse_attention_reference
from kernels_pallas.block_sparse_attention.xla import block_sparse_attention_xla

IMPLEMENTATIONS = ("auto", "xla", "pallas", "reference")
# As in flash_attention/ops.py: "auto" picks Pallas only where the kernels have been compiled,
# the GPU (Triton) path; on TPU "pallas" runs the Mosaic kernels and "auto" stays on XLA (see
# common.AUTO_PALLAS_BACKENDS).


def _check(q, k, v, block_indices, block_counts, segment_ids, block_size, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    B, T, H, K, D = check_qkv(q, k, v, segment_ids)
    nq = -(-T // block_size)
    if block_indices.ndim != 4 or tuple(block_indices.shape[:3]) != (B, K, nq):
        raise ValueError(
            f"block_indices.shape={tuple(block_indices.shape)} must be (B, K, q_blocks, max_blocks)"
            f" with (B, K, q_blocks)={(B, K, nq)} (T={T}, {block_size=})"
        )
    if tuple(block_counts.shape) != (B, K, nq):
        raise ValueError(f"block_counts.shape={tuple(block_counts.shape)} must be {(B, K, nq)}")
    for name, x in (("block_indices", block_indices), ("block_counts", block_counts)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {name}.dtype={x.dtype}")


def block_sparse_attention(
    q,
    k,
    v,
    block_indices,
    block_counts,
    segment_ids=None,
    block_size: int = 128,
    implementation: str = "auto",
    interpret: bool | None = None,
):
    """Causal, document-masked attention restricted to selected key blocks.

    q [B,T,H,D], k/v [B,T,K,D] (H % K == 0; query head h reads kv head h // (H // K)).
    block_indices [B,K,nq,max_blocks] int: for each (row, kv head, query block of
    `block_size` tokens) the key blocks it attends to; block_counts [B,K,nq] int: how many of
    those entries are valid (the rest are ignored, whatever they hold). nq = ceil(T /
    block_size); T need not be a multiple of block_size. Inside a selected block token i
    sees token j iff j <= i and segment_ids[i] == segment_ids[j] (padding is 0; None = one
    document). Valid entries that repeat an earlier one count once; out-of-range valid
    entries select nothing. A row that sees nothing outputs 0. Output has q's dtype.
    Not differentiable in block_indices / block_counts / segment_ids.
    `interpret` only matters for the Pallas kernels (see the module doc).
    """
    _check(q, k, v, block_indices, block_counts, segment_ids, block_size, implementation)
    if implementation == "reference":
        return block_sparse_attention_reference(
            q, k, v, block_indices, block_counts, segment_ids, int(block_size)
        )
    implementation, interpret = resolve_implementation(implementation, interpret)
    if implementation == "pallas" and pallas_target() == "mosaic":
        return block_sparse_attention_mosaic(
            q, k, v, block_indices, block_counts, segment_ids, int(block_size), interpret
        )
    if implementation == "pallas":
        return block_sparse_attention_pallas(
            q, k, v, block_indices, block_counts, segment_ids, int(block_size), interpret
        )
    return block_sparse_attention_xla(
        q, k, v, block_indices, block_counts, segment_ids, int(block_size)
    )
