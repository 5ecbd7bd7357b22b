"""Flash attention with document (segment) masking and grouped-query heads.

`flash_attention` is the public entry point; `attention_reference` is the dense oracle.
`attention_chunk` (chunk.py) is the per-round op of ring attention: a query chunk against one
key/value chunk, masked per token by (segment id, position), returning output and lse.
"""

from kernels_pallas.flash_attention.chunk import attention_chunk
from kernels_pallas.flash_attention.ops import BlockSizes, flash_attention
from kernels_pallas.flash_attention.reference import attention_reference, chunk_reference

__all__ = ["BlockSizes", "attention_chunk", "attention_reference", "chunk_reference",
           "flash_attention"]
