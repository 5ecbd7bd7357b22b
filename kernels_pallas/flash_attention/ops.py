"""Public entry point: `flash_attention` checks its arguments and dispatches.

implementation:
  "xla"       blocked online-softmax attention with a recomputing custom_vjp (xla.py);
  "pallas"    Pallas kernels, FlashAttention-2 forward / dQ / dK,dV: pallas.py (Triton) on GPU
              and in the CPU interpreter, pallas_tpu.py (Mosaic) on TPU;
  "reference" the dense jnp oracle (reference.py), O(T^2) memory;
  "auto"      "pallas" when jax.default_backend() is "gpu", else "xla" (TPU: see
              common.AUTO_PALLAS_BACKENDS).

interpret (Pallas only): None = run the kernels in the Pallas interpreter iff the backend is
CPU (slow; for tests); True / False force it. Compiled Pallas on CPU does not exist.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kernels_pallas.common import check_qkv, pallas_target, resolve_implementation
from kernels_pallas.flash_attention.pallas import flash_attention_pallas
from kernels_pallas.flash_attention.pallas_tpu import flash_attention_mosaic
from kernels_pallas.flash_attention.reference import attention_reference
from kernels_pallas.flash_attention.xla import flash_attention_xla

IMPLEMENTATIONS = ("auto", "xla", "pallas", "reference")


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


# Pallas holds a [block_q, block_k] float32 score tile per program (registers / shared memory
# on GPU), so its blocks are smaller than the XLA version's. Mosaic (TPU) blocks are multiples
# of 128 tokens (its (8, 128) tiling); 512 keeps the grid short (each step costs ~0.35 us) and
# the MXU (128 or 256 wide) full, as TPU attention kernels usually do.
DEFAULT_BLOCKS = {"xla": BlockSizes(256, 256), "pallas": BlockSizes(128, 64),
                  "mosaic": BlockSizes(512, 512)}
# float32 on TPU: a full-precision matmul is six bf16 MXU passes, and at 512 x 512 blocks the
# float32 programs compiled 2-3x slower than bfloat16 ones (flash fwd + bwd, T = 4096,
# D = 128, v5p: 2.0 s; 1.2 s at 256 x 256). Six passes give a 256 x 256 step more MXU work
# than a 512 x 512 bf16 step, so the ~0.35 us per grid step stays small beside it.
MOSAIC_FLOAT32_BLOCKS = BlockSizes(256, 256)
# float32 on GPU: each matmul is three TF32 tensor-core passes (common.triton_dot), and at
# 128 x 64 the float32 backward took 4-6 s to compile for A100 (fwd + bwd, T = 4096: D = 64
# 4.3 s, D = 128 5.9 s; 1.2 s and 2.3 s at 64 x 32). At D = 128, 64 x 32 still compiled
# 2-2.5x slower than JAX's own Triton attention at its largest tile that fits (64 x 64, one TF32
# pass; fwd + bwd, T = 4096: H100 1.8 s, A100 3.1 s; 1.5 s and 1.3 s at 32 x 32, the tile of
# that kernel's own backward). Run time at either tile is unmeasured (no GPU yet).
# bf16 keeps 128 x 64.
TRITON_FLOAT32_BLOCKS = BlockSizes(32, 32)
FLOAT32_BLOCKS = {"mosaic": MOSAIC_FLOAT32_BLOCKS, "pallas": TRITON_FLOAT32_BLOCKS}


def default_blocks(implementation: str, dtype) -> BlockSizes:
    """The blocks an implementation takes when the caller names none, for inputs of dtype."""
    if jnp.dtype(dtype) == jnp.float32 and implementation in FLOAT32_BLOCKS:
        return FLOAT32_BLOCKS[implementation]
    return DEFAULT_BLOCKS[implementation]


def _check(q, k, v, segment_ids, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    check_qkv(q, k, v, segment_ids)


def flash_attention(
    q,
    k,
    v,
    segment_ids=None,
    causal: bool = True,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
):
    """Attention with a document mask: token i sees token j iff their segment ids are equal
    and (not causal or j <= i). Padding carries segment id 0. Output has q's dtype.

    q [B,T,H,D], k/v [B,T,K,D], H % K == 0 (query head h uses kv head h // (H // K)),
    segment_ids [B,T] integer or None (one document per row). T need not be a multiple of
    the block sizes; None picks the implementation's default (`default_blocks`).
    `interpret` only matters for the Pallas kernels (see the module doc).
    """
    _check(q, k, v, segment_ids, implementation)
    if implementation == "reference":
        # same argument errors on every path
        BlockSizes(*(1 if b is None else b for b in (block_q, block_k)))
        return attention_reference(q, k, v, segment_ids, causal)
    implementation, interpret = resolve_implementation(implementation, interpret)
    if implementation == "pallas" and pallas_target() == "mosaic":
        implementation = "mosaic"
    default = default_blocks(implementation, q.dtype)
    blocks = BlockSizes(
        default.block_q if block_q is None else block_q,
        default.block_k if block_k is None else block_k,
    )
    if implementation == "mosaic":
        return flash_attention_mosaic(
            q, k, v, segment_ids, bool(causal), blocks.block_q, blocks.block_k, interpret
        )
    if implementation == "pallas":
        return flash_attention_pallas(
            q, k, v, segment_ids, bool(causal), blocks.block_q, blocks.block_k, interpret
        )
    return flash_attention_xla(
        q, k, v, segment_ids, bool(causal), blocks.block_q, blocks.block_k
    )
