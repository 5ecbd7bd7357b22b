"""Per-layer statistics the model sows while it runs (e.g. the sparse router's selected blocks
and coverage), collected by the train steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


# Statistics that add up over layers, calls, devices and micro-batches (counts and sums); the
# worst case over all of them (the runtime floor's largest coverage drop of any document, its
# smallest coverage); the others are means. attn_block_pairs stays per device in the executor's
# step (work balance).
SUMMED_STATS = ("coverage_bin_sums", "coverage_bin_blocks", "attn_block_pairs")
MAX_STATS = ("floor_drop_max",)
MIN_STATS = ("floor_coverage_min",)
PER_DEVICE_STATS = ("attn_block_pairs",)


def combine_stat(name: str, stacked: jax.Array) -> jax.Array:
    """One statistic over its first axis (layers, calls, devices or micro-batches): summed for
    SUMMED_STATS, the max / min for MAX_STATS / MIN_STATS, else the mean."""
    if name in SUMMED_STATS:
        return jnp.sum(stacked, 0)
    if name in MAX_STATS:
        return jnp.max(stacked, 0)
    if name in MIN_STATS:
        return jnp.min(stacked, 0)
    return jnp.mean(stacked, 0)


def host_scalars(stats: dict) -> dict[str, float]:
    """The scalar entries of `pop_layer_stats`' result as host floats (per-bin arrays left out)."""
    return {name: float(v) for name, v in jax.device_get(stats).items() if jnp.ndim(v) == 0}


def pop_layer_stats(model: nnx.Module) -> dict[str, jax.Array]:
    """Over layers, the values the model sowed as nnx.Intermediate (e.g. the sparse router's
    selected blocks and coverage), combined by `combine_stat`; empty for dense attention."""
    sown = nnx.to_pure_dict(nnx.pop(model, nnx.Intermediate))
    by_name: dict[str, list] = {}
    for path, value in jax.tree_util.tree_leaves_with_path(sown):
        names = [getattr(k, "key", None) for k in path]
        name = next(n for n in reversed(names) if isinstance(n, str))
        by_name.setdefault(name, []).append(value)
    return {name: combine_stat(name, jnp.stack(values)) for name, values in sorted(by_name.items())}
