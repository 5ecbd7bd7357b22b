"""The one place the model calls an attention kernel.

All attention in jaxsb goes through `attend`, which forwards to
`kernels_pallas.flash_attention.flash_attention` with the implementation and block size
chosen in `ModelConfig` (`attention`, `attention_block`). The kernel package is imported on
first use so that importing the model does not pull in kernel code (or fail while it is
being built).

Mask semantics (owned by the kernel): token i attends to token j iff
segment_ids[i] == segment_ids[j] and j <= i. Segment id 0 marks padding.
"""

from __future__ import annotations

import jax


def _kernel():
    try:
        from kernels_pallas.flash_attention import flash_attention
    except ImportError as e:  # pragma: no cover - depends on the checkout
        raise ImportError(
            "jaxsb.models.attention needs kernels_pallas.flash_attention.flash_attention "
            f"(blocked attention kernel), which could not be imported: {e}") from e
    return flash_attention


def attend(q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array,
           segment_ids_BxT: jax.Array | None, *, implementation: str = "xla",
           block: int = 256) -> jax.Array:
    """Causal, document-masked attention with grouped kv heads; returns [B,T,H,D] in q.dtype.

    `implementation` is `ModelConfig.attention` ("xla" blocked online softmax, "reference"
    dense oracle); `block` is `ModelConfig.attention_block`, used for both q and k blocks.
    """
    heads, kv_heads = q_BxTxHxD.shape[2], k_BxTxKxD.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads=} must be a multiple of {kv_heads=}")
    flash_attention = _kernel()
    # segment ids go positionally: the kernel names that parameter `segment_ids_BxT`
    return flash_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, causal=True,
                           implementation=implementation, block_q=block, block_k=block)
