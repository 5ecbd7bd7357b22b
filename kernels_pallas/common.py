"""Pieces shared by the attention kernels (XLA and Pallas): the finite "minus infinity", dot
helpers that accumulate in float32, padding along one axis, and the Pallas GPU compiler
parameters."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# "auto" picks Pallas only where the kernels have run: the GPU (Triton) path. On TPU
# implementation="pallas" runs the Mosaic kernels (mosaic.py): libtpu compiles them
# (tests/targets/), but no TPU has run them, so their numerics are checked only in the TPU
# interpreter and their speed not at all; "auto" stays on XLA there until one has
# (flash_attention/README.md, "auto on TPU").
AUTO_PALLAS_BACKENDS = ("gpu",)
PALLAS_BACKENDS = ("gpu", "tpu")

# Finite on purpose: exp(NEG - m) underflows to exactly 0 for any real running max m, and
# NEG - NEG stays 0 (an infinite value would give NaN there).
NEG = -1e30
HI = lax.Precision.HIGHEST
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b
NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class BlockGrid:
    """Static blocking of one attention call: T tokens cut into query blocks of bq and key
    blocks of bk, the last ones padded (hashable: part of custom_vjps' nondiff arguments)."""

    T: int
    D: int
    bq: int
    bk: int
    causal: bool
    interpret: bool

    @property
    def nq(self) -> int:
        return -(-self.T // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.T // self.bk)

    @property
    def Tq(self) -> int:
        return self.nq * self.bq

    @property
    def Tk(self) -> int:
        return self.nk * self.bk

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.D)


def range_of_true(x_BxNxM):
    """[B, N, 2] int32: [first, last + 1) of the True entries on the last axis; [0, 0) if none.
    Plain min / max reductions over the positions (argmax's index-carrying reduction
    compiled slower on TPU and GPU)."""
    m = x_BxNxM.shape[-1]
    pos = jnp.arange(m, dtype=jnp.int32)
    last1 = jnp.where(x_BxNxM, pos + 1, 0).max(-1)
    first = jnp.where(x_BxNxM, pos, m).min(-1)
    return jnp.stack([jnp.where(last1 > 0, first, 0), last1], axis=-1)


def dot(a, b, dims):
    """lax.dot_general at full precision, accumulating in float32."""
    return lax.dot_general(a, b, dims, precision=(HI, HI), preferred_element_type=jnp.float32)


def triton_dot(a, b, dims, interpret: bool):
    """A matmul of the Triton kernels, accumulating in float32 with the operands in their own
    dtype: bf16 / f16 go to the tensor cores as they are; float32 ones compiled for the GPU run
    as 3xTF32 (tensor cores, float32-level accuracy; plain float32 there means scalar FMA
    loops, ~10x slower to compile and to run), interpreted at full float32 precision."""
    if a.dtype == jnp.float32 and not interpret:
        return lax.dot_general(a, b, dims, precision=lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                               preferred_element_type=jnp.float32)
    return dot(a, b, dims)


def unless_skip(kind, skip: int, update, carry):
    """In a Triton kernel's walk over block pairs: update(carry) unless the pair's kind is `skip`.
    The other kinds (FULL, PARTIAL) share one masked body (a FULL pair's mask is all true): a
    second, unmasked copy of the body, as the XLA paths have, doubled the kernels' code and
    compile time (flash fwd + bwd at T = 1024, D = 64, bf16 for H100: 3.6-3.9 s against
    2.0-2.6 s) to save a few elementwise ops per pair."""
    return lax.cond(kind == skip, lambda c: c, update, carry)


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


def check_qkv(q, k, v, segment_ids) -> tuple[int, int, int, int, int]:
    """Argument checks shared by the attention entry points (messages show the values).
    Returns (B, T, H, K, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, T, heads, head_dim], got {name}.shape={x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {name}.dtype={x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape=} {v.shape=}")
    B, T, H, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, T, D):
        raise ValueError(f"q [B,T,H,D] and k [B,T,K,D] disagree on B, T or D: {q.shape=} {k.shape=}")
    K = k.shape[2]
    if H % K != 0:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads K={K}")
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (B, T):
            raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)} must be (B, T)={(B, T)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integer, got {segment_ids.dtype=}")
    return B, T, H, K, D


def _platform_name(platform: str) -> str:
    platform = str(platform).lower()
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


@contextlib.contextmanager
def compile_platform(platform: str | None):
    """Programs traced inside this block are compiled for `platform` ("tpu", "gpu" or "cuda",
    "cpu"; None changes nothing). Ahead-of-time compilation for devices this host does not have
    (compile-only TPU topologies, deviceless GPU targets) says where the program will run, so
    the kernels are chosen for that platform, not for the host's CPU. It is JAX's own default
    device setting (`jax.default_device(platform)`), which jit's caches key on: a function traced
    for one platform is traced again for another. Only trace and lower inside the block: arrays
    created eagerly there would go to that platform."""
    if platform is None:
        yield
        return
    with jax.default_device(_platform_name(platform)):
        yield


def target_backend() -> str:
    """The platform the program being traced is compiled for: JAX's default device when one is
    set (`compile_platform`, or a user's `jax.default_device(...)`), else jax.default_backend().
    Every kernel choice (the implementation, interpreted or not, Mosaic or Triton) is made from
    this, never from the host's backend directly."""
    device = jax.config.jax_default_device
    if device is None:
        return _platform_name(jax.default_backend())
    return _platform_name(device if isinstance(device, str) else device.platform)


def resolve_implementation(implementation: str, interpret: bool | None) -> tuple[str, bool]:
    """("xla" | "pallas", interpret) for an entry point's "auto" | "xla" | "pallas" choice:
    "auto" is Pallas on AUTO_PALLAS_BACKENDS, XLA elsewhere; Pallas interprets on a CPU target
    unless told otherwise, and compiled Pallas for an unsupported platform is refused. The
    platform is `target_backend()`: where the program is compiled, not the host."""
    backend = target_backend()
    if implementation == "auto":
        implementation = "pallas" if backend in AUTO_PALLAS_BACKENDS else "xla"
    if implementation != "pallas":
        return implementation, False
    if interpret is None:
        interpret = backend == "cpu"
    if not interpret and backend not in PALLAS_BACKENDS:
        raise ValueError(
            f"compiled Pallas needs a target platform in {PALLAS_BACKENDS}, got {backend!r}; "
            "pass interpret=True (or None) to use the Pallas interpreter, or compile for a TPU or "
            "GPU target (kernels_pallas.compile_platform, python -m jaxsb.compile)"
        )
    return implementation, bool(interpret)


def pallas_target() -> str:
    """Which Pallas kernels implementation="pallas" runs: "mosaic" (mosaic.py, TPU layout and
    scalar prefetch) when compiling for a TPU, else "triton" (the GPU kernels; on a CPU host
    they run in the interpreter)."""
    return "mosaic" if target_backend() == "tpu" else "triton"


# A program whose float32 score tile has this many elements or more runs on eight warps, not
# four. At four, ptxas took 1.5-3x longer on the 128 x 64 (and 128 x 128, 64 x 64) tiles of the
# three kernels (flash fwd + bwd, T = 4096, D = 128, bf16, H100: 1.50 s -> 0.89 s; D = 64:
# 1.05 -> 0.73 s; kernels_pallas/compile_times.md), as each thread held twice the tile. JAX's
# own Triton attention (`pallas.ops.gpu.attention.mha`) runs its 128 x 128 forward on eight warps
# at D > 64 and its 32 x 32 backward on four.
EIGHT_WARPS_TILE_ELEMENTS = 64 * 64


# The Triton backward kernels (dQ, dK/dV) work on tiles of at most this many rows and columns,
# whatever the forward's tile: JAX's own Triton attention (`pallas.ops.gpu.attention.mha`) runs
# its backward on 32 x 32 by default. A backward holds more live tiles than a forward (p, dS,
# dP and two [tile, D] accumulators); at the forward's bf16 128 x 64 the forward + backward
# programs compiled 15-20% slower (T = 4096, D = 128, bf16, A100, the same process: flash
# 1.09 -> 0.90 s, the chunk op 1.03 -> 0.89 s, block-sparse 0.90 -> 0.75 s; block-sparse at
# D = 64 on H100, 128-row tiles: 1.03 -> 0.74 s). Run time at either tile is unmeasured (no GPU
# yet; scripts/gpu_check.sh times the kernels where there is one).
TRITON_BACKWARD_TILE = 32


def backward_tile(b: int) -> int:
    """A backward tile from a forward one of b rows: TRITON_BACKWARD_TILE when that divides b
    (so the backward's padded length is never the forward's plus), else b (interpreted tiles
    that are not powers of two, and those of TRITON_BACKWARD_TILE rows or fewer)."""
    return TRITON_BACKWARD_TILE if b % TRITON_BACKWARD_TILE == 0 else b


def backward_blocks(blocks):
    """The backward's grid of a Triton kernel's blocks (a dataclass with bq and bk: flash's,
    the chunk op's): the forward's tiles cut to `backward_tile`, so its padded lengths are at
    most the forward's (forward outputs are sliced for it, never padded)."""
    return dataclasses.replace(blocks, bq=backward_tile(blocks.bq), bk=backward_tile(blocks.bk))


def triton_layout(x_BxTxNxD, T_pad: int, D_pad: int):
    """[B, T, N, D] -> [B, T_pad, N, D_pad] for the Triton kernels: zero padding only, heads
    stay where the caller has them (no data moves when T and D are already whole). The
    kernels read one head's [rows, D_pad] block with a stride of N * D_pad (`head_block`), as
    JAX's own GPU attention does; transposing to [B, N, T, D] instead took a copy per array
    and its fusion's compile (flash fwd + bwd, T = 4096, D = 128, float32, A100: about 0.2 s
    of 1.6 s)."""
    return pad_axis(pad_axis(x_BxTxNxD, 1, T_pad), 3, D_pad)


def triton_unlayout(x_BxTpxNxDp, T: int, D: int, dtype):
    """The inverse of `triton_layout`: -> [B, T, N, D] in dtype."""
    return x_BxTpxNxDp[:, :T, :, :D].astype(dtype)


def head_block(rows: int, D_pad: int, index):
    """BlockSpec of one head's [rows, D_pad] block of a [B, T, N, D_pad] array;
    index(*grid) -> (batch row, block along the tokens, head)."""
    return pl.BlockSpec((None, rows, None, D_pad), lambda *a: (*index(*a), 0))


def group_block(rows: int, G: int, D_pad: int, index):
    """BlockSpec of the G query heads of one kv head, [rows, G, D_pad], of a [B, T, H, D_pad]
    array viewed as [B, T, K, G, D_pad] (a free reshape); index(*grid) -> (batch row, kv
    head); rows are the whole (padded) length."""
    def block_index(*grid):
        b, kv_head = index(*grid)
        return b, 0, kv_head, 0, 0

    return pl.BlockSpec((None, rows, None, G, D_pad), block_index)


def kv_groups(x_BxTxHxD, K: int):
    """[B, T, H, D] -> [B, T, K, G, D], the G = H / K query heads of each kv head (a free
    reshape; read by `group_block`)."""
    B, T, H, D = x_BxTxHxD.shape
    return x_BxTxHxD.reshape(B, T, K, H // K, D)


def kv_group_rows(x_BxHxT, K: int):
    """[B, H, T] -> [B, K, G, T]: per-row statistics (lse, delta) grouped as `kv_groups`."""
    B, H, T = x_BxHxT.shape
    return x_BxHxT.reshape(B, K, H // K, T)


def row_delta(do_BxTxHxD, o_BxTxHxD):
    """float32 [B, H, T]: rowsum(dO * O) of the backward, from arrays in `triton_layout`."""
    return (do_BxTxHxD.astype(jnp.float32) * o_BxTxHxD.astype(jnp.float32)).sum(-1).transpose(0, 2, 1)


def triton_compiler_params(interpret: bool, tile_elements: int):
    """Compiled Pallas on GPU goes through the Triton lowering, chosen explicitly: in this JAX
    jax_pallas_use_mosaic_gpu defaults to True, and a pallas_call without compiler params would
    go to Mosaic GPU (Hopper+ only; see flash_attention/README.md). Chosen whenever the kernel
    is compiled, not from jax.default_backend(): a program may be lowered for a platform other
    than the host's (jax.export, ahead-of-time compilation). tile_elements: rows x columns of
    the program's score tile (EIGHT_WARPS_TILE_ELEMENTS)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    num_warps = 8 if tile_elements >= EIGHT_WARPS_TILE_ELEMENTS else 4
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=2)


_STRUCT_PARAMS = inspect.signature(jax.ShapeDtypeStruct).parameters


def varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over (empty outside shard_map or with check_vma=False)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10+
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older JAX


def out_struct(shape, dtype, like):
    """ShapeDtypeStruct that varies over the same mesh axes as `like` (pallas_call under
    shard_map(check_vma=True) wants them on every out_shape; the keyword changed names)."""
    aval = jax.typeof(like)
    if "manual_axis_type" in _STRUCT_PARAMS and getattr(aval, "manual_axis_type", None) is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    if "vma" in _STRUCT_PARAMS and hasattr(aval, "vma"):
        return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
    return jax.ShapeDtypeStruct(shape, dtype)
