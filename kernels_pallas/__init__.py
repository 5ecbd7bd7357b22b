"""Attention kernels for jaxsb: one folder per kernel (reference oracle, XLA version, ops)."""

from kernels_pallas.flash_attention import attention_reference, flash_attention

__all__ = ["attention_reference", "flash_attention"]
