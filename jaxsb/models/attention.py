"""The one place the model calls an attention kernel.

All attention in jaxsb goes through `attend`, which forwards to
`kernels_pallas.flash_attention.flash_attention` with the implementation and block size
chosen in `ModelConfig` (`attention`, `attention_block`). The kernel package is imported on
first use so that importing the model does not pull in kernel code (or fail while it is
being built).

Mask semantics (owned by the kernel): token i attends to token j iff
segment_ids[i] == segment_ids[j] and j <= i. Segment id 0 marks padding.

Under sequence parallelism the executor (jaxsb/parallel/executor.py) replaces the model's
attention while it traces a device's share of a plan: `attention_override(fn)` makes every
attention layer call `fn(q, k, v, segment_ids, budgets) -> (out, stats)` instead, where `fn`
knows the device's group, scheme and token positions. It is a trace-time setting (a context
variable), so the model's signature does not change with the layout.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp

from jaxsb.config import SINGLE_DEVICE_ATTENTION

_OVERRIDE: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("jaxsb_attention_override",
                                                                           default=None)


@contextlib.contextmanager
def attention_override(fn: Callable):
    """Within the block, attention layers call `fn(q, k, v, segment_ids, budgets) -> (out, stats)`;
    `stats` is a dict of scalars the layer sows (e.g. sparse_blocks, sparse_coverage)."""
    token = _OVERRIDE.set(fn)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def current_override() -> Callable | None:
    return _OVERRIDE.get()


def _kernel():
    from kernels_pallas.flash_attention import flash_attention

    return flash_attention


def attend(q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array,
           segment_ids_BxT: jax.Array | None, *, implementation: str = "xla",
           block: int = 256) -> jax.Array:
    """Causal, document-masked attention with grouped kv heads; returns [B,T,H,D] in q.dtype.

    `implementation` is `ModelConfig.attention` ("xla" blocked online softmax, "flash" the
    kernel's "auto" choice, "reference" dense oracle, "jax" `jax.nn.dot_product_attention` with an explicit mask, the baseline of
    scripts/bench_train.py); `block` is `ModelConfig.attention_block`, used for both q and k blocks.
    """
    heads, kv_heads = q_BxTxHxD.shape[2], k_BxTxKxD.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads=} must be a multiple of {kv_heads=}")
    if implementation == "jax":
        return _jax_dot_product_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT)
    if implementation == "flash":
        implementation = "auto"  # Pallas on GPU, the blocked XLA kernel elsewhere
    flash_attention = _kernel()
    # segment ids go positionally: the kernel names that parameter `segment_ids_BxT`
    return flash_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, causal=True,
                           implementation=implementation, block_q=block, block_k=block)


def _jax_dot_product_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT):
    """`jax.nn.dot_product_attention` with the same causal document mask, materialised [B,1,T,T]."""
    T = q_BxTxHxD.shape[1]
    causal_TxT = jnp.tril(jnp.ones((T, T), bool))
    if segment_ids_BxT is None:
        mask_Bx1xTxT = causal_TxT[None, None]
    else:
        same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
        mask_Bx1xTxT = (same_BxTxT & causal_TxT)[:, None]
    return jax.nn.dot_product_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask=mask_Bx1xTxT)


def sparse_attend(q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array,
                  segment_ids_BxT: jax.Array, budgets_B: jax.Array, *, block_size: int):
    """Routed block-sparse attention: each query block attends to its `budgets_B[b]` best key
    blocks (diagonal always). Returns (out [B,T,H,D], mean selected blocks, mean coverage)."""
    from jaxsb.models.router import route
    from kernels_pallas import block_sparse_attention

    block_indices, block_counts, coverage = route(q_BxTxHxD, k_BxTxKxD, segment_ids_BxT, budgets_B,
                                                  block_size=block_size)
    out = block_sparse_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, block_indices, block_counts,
                                 segment_ids_BxT, block_size=block_size)
    return out, jnp.mean(block_counts.astype(jnp.float32)), jnp.mean(coverage.per_row)


def ring_implementation(model_cfg) -> str:
    """The chunk-kernel implementation the executor's rings run for `model.attention` — the one
    place that maps it: flash and sparse -> "auto" (Pallas on GPU/TPU, XLA elsewhere, as `attend`
    and `sparse_attend`), xla -> "xla". The single-device oracles (reference, jax) have no ring
    version: refused here, and at config time with a planner (jaxsb.config)."""
    if model_cfg.attention in SINGLE_DEVICE_ATTENTION:
        raise ValueError(f"model.attention={model_cfg.attention!r} has no ring (sequence-parallel) version; "
                         "use xla, flash or sparse")
    return "xla" if model_cfg.attention == "xla" else "auto"
