"""Block-sparse attention: each query block attends to a per-sequence list of key blocks.

`block_sparse_attention` is the public entry point; `block_sparse_attention_reference` is the
dense oracle. The block lists come from `jaxsb.models.router.route` (host-side metadata per step).
"""

from kernels_pallas.block_sparse_attention.ops import block_sparse_attention
from kernels_pallas.block_sparse_attention.reference import (
    block_sparse_attention_reference,
    block_sparse_mask,
)

__all__ = ["block_sparse_attention", "block_sparse_attention_reference", "block_sparse_mask"]
