"""Every kernel as a program to compile ahead of time for a device this host may not have.

`kernel_programs(case, device)` gives, for one shape case, the compiled-Pallas programs of the
three kernels — flash attention, block-sparse attention and the ring's chunk op — forward alone
and forward + backward (the vjp with a cotangent), with abstract inputs on `device` (a
compile-only TPU or deviceless GPU device, or a real one). `compile_program` lowers them for the
device's platform (`common.compile_platform`: Mosaic on TPU, Triton on GPU) and compiles,
timing both. Used by the compile-target tests and `scripts/compile_kernels.py`; numerics are
checked elsewhere (the interpreter suites): this only proves the real compiler accepts them.

Entry layout: how q, k, v come in and the output goes out. Inside a layer
(jaxsb/models/llama.py) a kernel gets q, k, v from the projections and RoPE ([B, T, N * D]
reshaped to [B, T, N, D]) and hands its output to the output projection, and the compiler lays
those intermediates out as the kernel wants them: compiled for TPU, the Mosaic kernels at
D = 128 read q from the RoPE fusion's output and the projection reads their output, with no
copy between. A program whose parameters are q, k, v has no such neighbours: with
`entry="bthd"` (the kernels' API, [B, T, N, D] parameters in the default layout) the TPU
compiler adds a relayout per array that no layer compiles ([B, T, N, D] and [B, T, N * D] tile
differently; about 0.15 s of a 0.5 s TPU forward at T = 4096, D = 128). `entry="model"`, the
default, stands in for the layer's neighbours: q, k, v as [B, T, N * D], their layouts and the
outputs' left to the compiler (`jax.experimental.layout` AUTO, `Program.free_layouts`).
`scripts/compile_kernels.py` gives JAX's GPU kernel the same and splash attention its own
[B, N, T, D] (AUTO too), so splash compiles no transpose from a layer's [B, T, N, D] while
jaxsb's Mosaic kernels at D = 64 transpose to [B, N, T, D] under both entries (the Triton
kernels, like JAX's, read [B, T, N, D] as it is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding

from kernels_pallas.block_sparse_attention import block_sparse_attention
from kernels_pallas.common import compile_platform
from kernels_pallas.flash_attention import flash_attention
from kernels_pallas.ring_chunk import attention_chunk

KERNELS = ("flash", "block_sparse", "ring_chunk")
DIRECTIONS = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape: B rows of T tokens, H query heads over K kv heads of width D."""

    T: int
    D: int = 128
    H: int = 8
    K: int = 2
    dtype: str = "bfloat16"
    B: int = 1
    block: int = 128  # block-sparse routing block
    max_blocks: int = 8  # block-sparse: selected key blocks per query block at most

    @property
    def label(self) -> str:
        return f"T={self.T} H={self.H}/{self.K} D={self.D} {self.dtype}"


@dataclasses.dataclass(frozen=True)
class Program:
    kernel: str
    direction: str
    case: Case
    fn: Callable
    args: tuple  # ShapeDtypeStructs on the device
    free_layouts: tuple = ()  # indices of args whose layout the compiler chooses (the outputs' too)

    @property
    def name(self) -> str:
        return f"{self.kernel} {self.direction} {self.case.label}"

    def compile(self, platform: str) -> Compiled:
        return compile_program(self.fn, self.args, platform, self.free_layouts)


def _with_vjp(fn: Callable, ndiff: int) -> Callable:
    """fn's output and the gradient of the first `ndiff` arguments for a unit-free cotangent:
    sum(out * out) keeps the cotangent data-dependent, so nothing is folded away."""

    def run(*args):
        def loss(*diff):
            out = fn(*diff, *args[ndiff:])
            out = out[0] if isinstance(out, tuple) else out
            return jnp.sum(jnp.square(out.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=tuple(range(ndiff)))(*args[:ndiff])

    return run


ENTRY_FREE_LAYOUTS = {"model": (0, 1, 2), "bthd": ()}  # q, k, v: the layout is the compiler's
ENTRIES = tuple(ENTRY_FREE_LAYOUTS)


def entry_heads(case: Case, n: int, dtype, sharding, entry: str) -> jax.ShapeDtypeStruct:
    """n heads of `case` as a program of `entry` takes them: [B, T, n * D] ("model") or
    [B, T, n, D] ("bthd")."""
    B, T, D = case.B, case.T, case.D
    shape = (B, T, n * D) if entry == "model" else (B, T, n, D)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def at_entry(fn: Callable, case: Case, entry: str) -> Callable:
    """fn(q [B,T,H,D], k, v [B,T,K,D], ...) as a program of `entry` calls it: unchanged for
    "bthd"; for "model" q, k, v [B, T, N * D] in and its output [B, T, H * D] out (an lse, if
    any, as it is)."""
    if entry != "model":
        return fn

    def run(q, k, v, *rest):
        B, T = q.shape[:2]
        out = fn(q.reshape(B, T, case.H, case.D), k.reshape(B, T, case.K, case.D),
                 v.reshape(B, T, case.K, case.D), *rest)
        if isinstance(out, tuple):
            return (out[0].reshape(B, T, -1), *out[1:])
        return out.reshape(B, T, -1)

    return run


def kernel_programs(case: Case, device, kernels=KERNELS, directions=DIRECTIONS,
                    entry: str = "model") -> list[Program]:
    """The compiled-Pallas programs of `kernels` x `directions` at `case`, inputs on `device`;
    `entry`: q, k, v and the output as a layer holds them ("model": [B, T, N * D], layouts the
    compiler's) or as the kernels' API takes them ("bthd": [B, T, N, D]); see the module doc."""
    if entry not in ENTRIES:
        raise ValueError(f"entry={entry!r} must be one of {ENTRIES}")
    sh = SingleDeviceSharding(device)
    dt = jnp.dtype(case.dtype)
    B, T, K = case.B, case.T, case.K
    q, kv = (entry_heads(case, n, dt, sh, entry) for n in (case.H, K))
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sh)
    nq = -(-T // case.block)
    idx = jax.ShapeDtypeStruct((B, K, nq, case.max_blocks), jnp.int32, sharding=sh)
    counts = jax.ShapeDtypeStruct((B, K, nq), jnp.int32, sharding=sh)
    compiled = dict(implementation="pallas", interpret=False)
    forwards = {
        "flash": (lambda q, k, v, s: flash_attention(q, k, v, s, **compiled), (q, kv, kv, ids)),
        "block_sparse": (lambda q, k, v, i, c, s: block_sparse_attention(q, k, v, i, c, s, case.block, **compiled),
                         (q, kv, kv, idx, counts, ids)),
        "ring_chunk": (lambda q, k, v, sq, pq, sk, pk: attention_chunk(q, k, v, sq, pq, sk, pk, **compiled),
                       (q, kv, kv, ids, ids, ids, ids)),
    }
    out = []
    for kernel in kernels:
        fn, args = forwards[kernel]
        fn = at_entry(fn, case, entry)
        for direction in directions:
            out.append(Program(kernel, direction, case, fn if direction == "fwd" else _with_vjp(fn, 3), args,
                               ENTRY_FREE_LAYOUTS[entry]))
    return out


# What a compiled Pallas kernel becomes in the lowered module, per platform.
KERNEL_CALLS = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}


@dataclasses.dataclass
class Compiled:
    lower_s: float
    compile_s: float  # lowering included
    lowered_text: str  # StableHLO: the kernels appear as KERNEL_CALLS[platform] custom calls
    compiled: object

    def kernel_calls(self, platform: str) -> int:
        return self.lowered_text.count(KERNEL_CALLS[platform])


def compile_program(fn: Callable, args: tuple, platform: str, free_layouts: tuple = ()) -> Compiled:
    """Lowers `fn` for `platform` and compiles it (raises what the compiler raises); the args at
    `free_layouts`, and then every output, get the layout the compiler chooses (AUTO)."""
    if free_layouts:
        shardings = tuple(Format(Layout.AUTO, a.sharding) if i in free_layouts else a.sharding
                          for i, a in enumerate(args))
        jit = jax.jit(fn, in_shardings=shardings, out_shardings=Format(Layout.AUTO, args[0].sharding))
    else:
        jit = jax.jit(fn)
    with _no_gc_pauses():
        t0 = time.perf_counter()
        with compile_platform(platform):
            lowered = jit.lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    return Compiled(t1 - t0, t2 - t0, lowered.as_text(), compiled)


@contextlib.contextmanager
def _no_gc_pauses():
    """Python's garbage collector off while a compile is timed, after a collection outside the
    timing, as `timeit` does: a sweep's process holds hundreds of programs' objects, and a
    full collection landing inside one compile (~0.3 s late in a sweep; the allocation counts
    that trigger it repeat round after round, so it can hit the same program every time) is the
    harness's cost, not the compiler's."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
