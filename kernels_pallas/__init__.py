"""Attention kernels for jaxsb: one folder per kernel (reference oracle, XLA version, ops)."""

from kernels_pallas.block_sparse_attention import block_sparse_attention
from kernels_pallas.common import compile_platform
from kernels_pallas.flash_attention import attention_reference, flash_attention

__all__ = ["attention_reference", "block_sparse_attention", "compile_platform", "flash_attention"]
