"""Per-layer statistics the model sows while it runs (e.g. the sparse router's selected blocks
and coverage), collected by the train steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def pop_layer_stats(model: nnx.Module) -> dict[str, jax.Array]:
    """Means over layers of the values the model sowed as nnx.Intermediate (e.g. the sparse
    router's selected blocks and coverage); empty for dense attention."""
    sown = nnx.to_pure_dict(nnx.pop(model, nnx.Intermediate))
    by_name: dict[str, list] = {}
    for path, value in jax.tree_util.tree_leaves_with_path(sown):
        names = [getattr(k, "key", None) for k in path]
        name = next(n for n in reversed(names) if isinstance(n, str))
        by_name.setdefault(name, []).append(value)
    return {name: jnp.mean(jnp.stack(values)) for name, values in sorted(by_name.items())}
