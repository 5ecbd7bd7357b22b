"""Pieces shared by the attention kernels (XLA and Pallas): the finite "minus infinity", dot
helpers that accumulate in float32, padding along one axis, and the Pallas GPU compiler
parameters."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Finite on purpose: exp(NEG - m) underflows to exactly 0 for any real running max m, and
# NEG - NEG stays 0 (an infinite value would give NaN there).
NEG = -1e30
HI = lax.Precision.HIGHEST
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b
NN = (((1,), (0,)), ((), ()))  # a @ b


def dot(a, b, dims):
    """lax.dot_general at full precision, accumulating in float32."""
    return lax.dot_general(a, b, dims, precision=(HI, HI), preferred_element_type=jnp.float32)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pad_axis(x, axis: int, n: int, mode: str = "constant", value=0):
    """x padded at the end of `axis` to length n (constant `value`, or numpy's `mode`)."""
    if x.shape[axis] == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    if mode == "constant":
        return jnp.pad(x, widths, constant_values=value)
    return jnp.pad(x, widths, mode=mode)


def triton_compiler_params(interpret: bool):
    """Compiled Pallas on GPU goes through the Triton lowering, chosen explicitly: in this JAX
    jax_pallas_use_mosaic_gpu defaults to True, and a pallas_call without compiler params would
    go to Mosaic GPU (Hopper+ only; see flash_attention/README.md). Chosen whenever the kernel
    is compiled, not from jax.default_backend(): a program may be lowered for a platform other
    than the host's (jax.export, ahead-of-time compilation)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=2)
