"""Rotary position embeddings: frequencies (plain or scaled for long context) and rotation.

`inverse_frequencies(head_dim, theta, rope)` gives the D/2 angular frequencies, computed once
in float64 numpy (they are static). Scaling rules, as published and as Hugging Face
transformers implements them under the same `rope_type` names:
  * default: f_i = theta^(-2i/D);
  * linear (position interpolation): f_i / factor;
  * llama3 (Llama 3.1): wavelengths 2π/f above original/low_freq_factor are divided by factor,
    below original/high_freq_factor kept, and smoothly interpolated in between;
  * yarn (Peng et al. 2023, "YaRN"): per dimension a ramp between the interpolated f_i/factor
    and the original f_i, bounded by the dimensions that turn beta_fast and beta_slow times over
    the original context, and cos/sin scaled by `attention_factor` (0.1·ln(factor) + 1 unless
    the checkpoint gives it).
Rotation uses the rotate-half convention: pairs (i, i + D/2) rotate together.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsb.config import RopeConfig


def _yarn(base: np.ndarray, head_dim: int, theta: float, rope: RopeConfig) -> np.ndarray:
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: the original frequency (extrapolate), 0: interpolated
    return base / rope.factor * (1.0 - keep) + base * keep


def inverse_frequencies(head_dim: int, theta: float, rope: RopeConfig = RopeConfig()) -> np.ndarray:
    """[D/2] float64 angular frequencies of rotate-half RoPE under `rope`'s scaling."""
    base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope.scaling == "default":
        return base
    if rope.scaling == "linear":
        return base / rope.factor
    if rope.scaling == "llama3":
        old = rope.original_max_positions
        wavelen = 2 * math.pi / base
        scaled = np.where(wavelen > old / rope.low_freq_factor, base / rope.factor, base)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= old / rope.high_freq_factor) & (wavelen <= old / rope.low_freq_factor)
        return np.where(medium, smoothed, scaled)
    if rope.scaling == "yarn":
        return _yarn(base, head_dim, theta, rope)
    raise ValueError(f"rope scaling {rope.scaling!r}: expected one of default, linear, llama3, yarn")


def rope_cos_sin(positions_BxT: jax.Array, head_dim: int, theta: float,
                 rope: RopeConfig = RopeConfig()) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B,T,D] (float32) for rotate-half RoPE at the given per-token positions."""
    inv_freq = jnp.asarray(inverse_frequencies(head_dim, theta, rope), jnp.float32)
    angles_BxTxD2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    angles_BxTxD = jnp.concatenate([angles_BxTxD2, angles_BxTxD2], axis=-1)
    scale = rope.attention_factor if rope.scaling == "yarn" else 1.0
    return jnp.cos(angles_BxTxD) * scale, jnp.sin(angles_BxTxD) * scale


def apply_rope(x_BxTxNxD: jax.Array, cos_BxTxD: jax.Array, sin_BxTxD: jax.Array) -> jax.Array:
    """Rotate-half convention: pairs (i, i + D/2) rotate together."""
    x = x_BxTxNxD.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_BxTxD[:, :, None, :] + rotated * sin_BxTxD[:, :, None, :]
    return out.astype(x_BxTxNxD.dtype)
