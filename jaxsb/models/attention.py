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
import math
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
    scripts/bench_train.py); `block` is `ModelConfig.attention_block`, used for both q and k blocks
    of the XLA kernel (also "flash" where it runs XLA; its Pallas kernels keep their own).
    """
    heads, kv_heads = q_BxTxHxD.shape[2], k_BxTxKxD.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads=} must be a multiple of {kv_heads=}")
    if implementation == "jax":
        return _jax_dot_product_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT)
    if implementation == "flash":
        implementation = "auto"  # Pallas on GPU, the blocked XLA kernel elsewhere
    flash_attention = _kernel()
    # `block` is the XLA kernel's; where "auto" picks Pallas, its kernels keep their own tiles
    # (the default 256 x 256 as a Triton tile asked an H100 for 576 KB of shared memory, of 227)
    blocks = {} if implementation == "auto" and _auto_is_pallas() else dict(block_q=block, block_k=block)
    # segment ids go positionally: the kernel names that parameter `segment_ids_BxT`
    return flash_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, causal=True,
                           implementation=implementation, **blocks)


def _auto_is_pallas() -> bool:
    from kernels_pallas.common import resolve_implementation

    return resolve_implementation("auto", None)[0] == "pallas"


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


def cached_attention(q_BxNxHxD: jax.Array, cache_k_BxSxKxD: jax.Array, cache_v_BxSxKxD: jax.Array,
                     positions_BxN: jax.Array) -> jax.Array:
    """Decode-step attention against a KV cache: a query at position p attends densely to the
    cache slots j <= p (slot = position; one document per row). float32 softmax; [B,N,H,D] in
    q's dtype. Dense as in MoBA's evaluation: sparsity is a prefill decision."""
    B, N, H, D = q_BxNxHxD.shape
    K = cache_k_BxSxKxD.shape[2]
    q_BxNxKxGxD = q_BxNxHxD.astype(jnp.float32).reshape(B, N, K, H // K, D)
    s_BxKxGxNxS = jnp.einsum("bnkgd,bskd->bkgns", q_BxNxKxGxD, cache_k_BxSxKxD.astype(jnp.float32),
                             precision=jax.lax.Precision.HIGHEST) / math.sqrt(D)
    slots_S = jnp.arange(cache_k_BxSxKxD.shape[1])
    visible_BxNxS = slots_S[None, None, :] <= positions_BxN[:, :, None]
    s_BxKxGxNxS = jnp.where(visible_BxNxS[:, None, None], s_BxKxGxNxS, -jnp.inf)
    p_BxKxGxNxS = jax.nn.softmax(s_BxKxGxNxS, axis=-1)
    out_BxNxKxGxD = jnp.einsum("bkgns,bskd->bnkgd", p_BxKxGxNxS, cache_v_BxSxKxD.astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST)
    return out_BxNxKxGxD.reshape(B, N, H, D).astype(q_BxNxHxD.dtype)


def sparse_attend(q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array,
                  segment_ids_BxT: jax.Array, budgets_B: jax.Array, *, block_size: int,
                  max_blocks: int | None = None, floor: tuple[int, float] | None = None, head_sum=None,
                  curve_bins: int | None = None):
    """Routed block-sparse attention: each query block attends to its `budgets_B[b]` best key
    blocks (diagonal always), after the runtime floor when `floor` = (k_base, p) is given
    (jaxsb.models.router). Returns (out [B,T,H,D], stats): `sparse_blocks` (mean selected
    blocks per query block), `sparse_coverage` (mean routing mass kept per row) and, with the
    floor, `floor_planned` / `floor_final` (the budgets before / after it) and `floor_overridden`
    (the share of query blocks it raised), those three weighted by real tokens, and the extremes
    `floor_drop_max` / `floor_coverage_min` (floor_stats); with
    `curve_bins`, `coverage_bin_sums` / `coverage_bin_blocks` (router.length_bin_sums); and
    `attn_block_pairs`, the (query block, key block) pairs the kernel computes (its tables'
    counts summed over rows and kv heads)."""
    from jaxsb.models.router import route
    from kernels_pallas import block_sparse_attention

    if max_blocks is not None:
        max_blocks = min(int(max_blocks), -(-q_BxTxHxD.shape[1] // block_size))
    block_indices, block_counts, coverage = route(q_BxTxHxD, k_BxTxKxD, segment_ids_BxT, budgets_B,
                                                  block_size=block_size, max_blocks=max_blocks, floor=floor,
                                                  head_sum=head_sum, curve_bins=curve_bins)
    out = block_sparse_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, block_indices, block_counts,
                                 segment_ids_BxT, block_size=block_size)
    stats = {"sparse_blocks": jnp.mean(block_counts.astype(jnp.float32)),
             "sparse_coverage": jnp.mean(coverage.per_row),
             "attn_block_pairs": jnp.sum(block_counts.astype(jnp.float32))}
    if coverage.floor is not None:
        stats.update(floor_stats(coverage.floor))
    return out, stats


def floor_stats(floor) -> dict:
    """Token-weighted means of the runtime floor's decisions (`router.Floor`), and over the
    query blocks holding real tokens the largest coverage drop against the base budget
    (`floor_drop_max`, 0 when none lost any: the floor keeps it <= p) and the smallest coverage
    at the final budgets (`floor_coverage_min`, 1 when there is no such block)."""
    w = floor.tokens
    total = jnp.maximum(w.sum(), 1.0)
    real = w > 0
    out = {"floor_planned": (floor.planned * w).sum() / total, "floor_final": (floor.final * w).sum() / total,
           "floor_overridden": (floor.overridden * w).sum() / total,
           "floor_drop_max": jnp.max(jnp.where(real, floor.drop, 0.0), initial=0.0),
           "floor_coverage_min": jnp.min(jnp.where(real, floor.coverage, 1.0), initial=1.0)}
    if floor.bin_sums is not None:
        out.update(coverage_bin_sums=floor.bin_sums, coverage_bin_blocks=floor.bin_blocks)
    return out


def sparse_options(model_cfg) -> dict:
    """sparse_attend's keyword options from `model.sparse` — the one place that maps them."""
    sp = model_cfg.sparse
    floor = (sp.top_k, sp.coverage_drop) if sp.coverage_drop < 1 else None
    bins = sp.max_blocks if floor is not None and sp.max_blocks else None
    return dict(block_size=sp.block_size, max_blocks=sp.max_blocks or None, floor=floor, curve_bins=bins)


def ring_implementation(model_cfg) -> str:
    """The chunk-kernel implementation the executor's rings run for `model.attention` — the one
    place that maps it: flash and sparse -> "auto" (Pallas on GPU/TPU, XLA elsewhere, as `attend`
    and `sparse_attend`), xla -> "xla". The single-device oracles (reference, jax) have no ring
    version: refused here, and at config time with a planner (jaxsb.config)."""
    if model_cfg.attention in SINGLE_DEVICE_ATTENTION:
        raise ValueError(f"model.attention={model_cfg.attention!r} has no ring (sequence-parallel) version; "
                         "use xla, flash or sparse")
    return "xla" if model_cfg.attention == "xla" else "auto"
