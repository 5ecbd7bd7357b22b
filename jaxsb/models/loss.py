"""Next-token cross-entropy over packed rows.

Returns the masked SUM and the masked COUNT rather than a mean so that the trainer can add
them across micro-batches and devices before dividing once: the mean is then over all real
targets of the step, whatever their split into rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_loss(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                    loss_mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum over masked tokens of -log p(target), sum of the mask), both float32 scalars.

    Targets where the mask is 0 may hold anything (e.g. -1 or padding ids); they are clipped
    into range and contribute nothing.
    """
    if logits_BxTxV.shape[:-1] != targets_BxT.shape or targets_BxT.shape != loss_mask_BxT.shape:
        raise ValueError(f"shape mismatch: logits {logits_BxTxV.shape}, targets {targets_BxT.shape}, "
                         f"loss_mask {loss_mask_BxT.shape}")
    logits = logits_BxTxV.astype(jnp.float32)
    vocab = logits.shape[-1]
    targets = jnp.clip(targets_BxT.astype(jnp.int32), 0, vocab - 1)
    log_z_BxT = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BxT = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    mask = loss_mask_BxT.astype(jnp.float32)
    nll_BxT = (log_z_BxT - target_logit_BxT) * mask
    return jnp.sum(nll_BxT), jnp.sum(mask)
