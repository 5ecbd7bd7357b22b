"""Public entry point: `flash_attention` checks its arguments and dispatches.

implementation:
  "xla"       blocked online-softmax attention with a recomputing custom_vjp (xla.py);
  "reference" the dense jnp oracle (reference.py), O(T^2) memory;
  "auto"      "xla" (a Pallas implementation for accelerators is later work).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kernels_pallas.flash_attention.reference import attention_reference
from kernels_pallas.flash_attention.xla import flash_attention_xla

IMPLEMENTATIONS = ("auto", "xla", "reference")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query / key block lengths of the blocked implementations (clamped to T)."""

    block_q: int = 256
    block_k: int = 256

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")


def _check(q, k, v, segment_ids, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, T, heads, head_dim], got {name}.shape={x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {name}.dtype={x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape=} {v.shape=}")
    B, T, H, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, T, D):
        raise ValueError(
            f"q [B,T,H,D] and k [B,T,K,D] disagree on B, T or D: {q.shape=} {k.shape=}"
        )
    K = k.shape[2]
    if H % K != 0:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads K={K}")
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (B, T):
            raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)} must be (B, T)={(B, T)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integer, got {segment_ids.dtype=}")


def flash_attention(
    q,
    k,
    v,
    segment_ids=None,
    causal: bool = True,
    implementation: str = "auto",
    block_q: int = 256,
    block_k: int = 256,
):
    """Attention with a document mask: token i sees token j iff their segment ids are equal
    and (not causal or j <= i). Padding carries segment id 0. Output has q's dtype.

    q [B,T,H,D], k/v [B,T,K,D], H % K == 0 (query head h uses kv head h // (H // K)),
    segment_ids [B,T] integer or None (one document per row). T need not be a multiple of
    the block sizes.
    """
    _check(q, k, v, segment_ids, implementation)
    blocks = BlockSizes(block_q, block_k)
    if implementation == "reference":
        return attention_reference(q, k, v, segment_ids, causal)
    return flash_attention_xla(
        q, k, v, segment_ids, bool(causal), blocks.block_q, blocks.block_k
    )
