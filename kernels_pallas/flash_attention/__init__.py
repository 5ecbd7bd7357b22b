"""Flash attention with document (segment) masking and grouped-query heads.

`flash_attention` is the public entry point; `attention_reference` is the dense oracle.
"""

from kernels_pallas.flash_attention.ops import BlockSizes, flash_attention
from kernels_pallas.flash_attention.reference import attention_reference

__all__ = ["BlockSizes", "attention_reference", "flash_attention"]
