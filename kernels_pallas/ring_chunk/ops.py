"""Attention of a query chunk against one key/value chunk, masked per token: the per-round
compute of ring attention (jaxsb/parallel/ring.py), as one op with an XLA and a Pallas version.

q [B, Lq, H, D] attends k/v [B, Lk, K, D] (H % K == 0, query head h reads kv head
h // (H // K)); query i sees key j iff seg_q[i] == seg_k[j] and pos_k[j] <= pos_q[i]. Nothing
depends on where a token sits, so chunks may hold tokens in any order (zigzag, shuffled).
Segment ids > 0 are documents, 0 is padding (its outputs are finite but unspecified: padding
pairs are computed only when `local`, see tables.py), ids < 0 are reserved.

  chunk_forward   -> (out float32 [B, Lq, H, D], lse float32 [B, Lq, H]) of this chunk alone;
                     a query that sees no key here gets out 0 and lse NEG, so chunks merge
                     exactly with `merge_chunks` (the ring's combine across rounds);
  chunk_backward  -> float32 (dq, dk, dv) of this chunk pair, given the caller's *global*
                     lse and delta = rowsum(dO * O) of the merged output (FlashAttention-2:
                     p = exp(s - lse) is then this pair's share of the full softmax);
  attention_chunk -> (out in q's dtype, lse), differentiable in q, k, v (custom_vjp; the
                     lse cotangent folds into delta: d lse / d s = p).

`select` (Pallas only, optional): bool [B, K, nq, nk] under the chunk's blocking, the block
pairs each row and kv head computes at all (block-sparse ring rounds); the others are SKIP.

`active` (a traced bool is fine) turns all work off: every block pair is SKIP, the outputs are
out 0 / lse NEG and zero gradients; a ring device whose ring has no round r uses it, so no
collective sits under a conditional. `local` says q and k are the same tokens (round 0).

implementation: "xla" (xla.py, batch-shared block table), "pallas" (pallas.py,
Triton, per-row tables; interpreted on a CPU host unless `interpret` says otherwise; on a TPU
backend it resolves to "mosaic", pallas_tpu.py), "auto" = Pallas
on common.AUTO_PALLAS_BACKENDS (GPU), XLA elsewhere, as for flash_attention. Blocks default to
flash_attention/ops.py's `default_blocks` of the implementation; L need not be a multiple of them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.common import pallas_target, resolve_implementation, varying_axes
from kernels_pallas.flash_attention.ops import default_blocks
from kernels_pallas.ring_chunk.pallas import chunk_backward_pallas, chunk_forward_pallas
from kernels_pallas.ring_chunk.pallas_tpu import chunk_backward_mosaic, chunk_forward_mosaic
from kernels_pallas.ring_chunk.tables import ChunkBlocks, make_chunk_blocks
from kernels_pallas.ring_chunk.xla import chunk_backward_xla, chunk_forward_xla

IMPLEMENTATIONS = ("auto", "xla", "pallas")
_FORWARD = {"xla": chunk_forward_xla, "pallas": chunk_forward_pallas,
            "mosaic": chunk_forward_mosaic}
_BACKWARD = {"xla": chunk_backward_xla, "pallas": chunk_backward_pallas,
             "mosaic": chunk_backward_mosaic}


def resolve_chunk_implementation(implementation: str, interpret: bool | None = None):
    """("xla" | "pallas" | "mosaic", interpret) for "auto" | "xla" | "pallas", as
    common.resolve_implementation decides it for flash_attention; "pallas" resolves to the
    kernels of the backend: "mosaic" (pallas_tpu.py) on TPU, "pallas" (Triton) elsewhere."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    implementation, interpret = resolve_implementation(implementation, interpret)
    if implementation == "pallas" and pallas_target() == "mosaic":
        implementation = "mosaic"
    return implementation, interpret


def _check(q, k, v, seg_q, pos_q, seg_k, pos_k):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating [B, L, heads, D] array, got "
                             f"{name}.shape={x.shape} {name}.dtype={x.dtype}")
    B, Lq, H, D = q.shape
    if k.shape != v.shape or (k.shape[0], k.shape[3]) != (B, D):
        raise ValueError(f"k and v must both be [B, Lk, K, D] with q's B and D: "
                         f"{q.shape=} {k.shape=} {v.shape=}")
    if H % k.shape[2]:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads K={k.shape[2]}")
    for name, x, L in (("seg_q", seg_q, Lq), ("pos_q", pos_q, Lq), ("seg_k", seg_k, k.shape[1]),
                       ("pos_k", pos_k, k.shape[1])):
        if tuple(x.shape) != (B, L) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer [B, L]={(B, L)} array, got "
                             f"{name}.shape={tuple(x.shape)} {name}.dtype={x.dtype}")


def check_interpreter_outside_vma(implementation: str, interpret: bool, q) -> None:
    """The Pallas interpreter of JAX 0.10 does not track shard_map's varying mesh axes (it
    fails deep inside its lowering); refuse that combination up front, with the way out."""
    if implementation != "xla" and interpret and varying_axes(q):
        raise ValueError(
            "the Pallas interpreter (interpret=True) does not track shard_map's varying mesh "
            f"axes ({sorted(varying_axes(q))}): run it under shard_map(check_vma=False), or "
            "use implementation='xla' or compiled Pallas")


def _setup(q, k, local, implementation, block_q, block_k, interpret) -> tuple[str, ChunkBlocks]:
    implementation, interpret = resolve_chunk_implementation(implementation, interpret)
    check_interpreter_outside_vma(implementation, interpret, q)
    default = default_blocks(implementation, q.dtype)
    blocks = make_chunk_blocks(
        q.shape[1], k.shape[1], q.shape[3],
        default.block_q if block_q is None else block_q,
        default.block_k if block_k is None else block_k,
        local, pallas=implementation != "xla", interpret=interpret,
        mosaic=implementation == "mosaic")
    return implementation, blocks


def _with_select(implementation: str, select):
    """kwargs passing a block selection on; the XLA chunk has none (its table is shared by
    the batch, and jaxsb/parallel/ring_sparse.py keeps its own XLA rounds)."""
    if select is None:
        return {}
    if implementation == "xla":
        raise ValueError(f"a block selection needs implementation='pallas', got {implementation=} "
                         "(the XLA block-sparse ring is jaxsb.parallel.ring_sparse's own code)")
    return {"select": select}


def forward_with_blocks(implementation: str, blocks: ChunkBlocks, q, k, v, seg_q, pos_q,
                        seg_k, pos_k, active=True, select=None):
    """chunk_forward for a resolved implementation ("xla" | "pallas" | "mosaic") and its blocks
    (tables.make_chunk_blocks), without argument checks: for callers that resolved them
    once (ring.py, ring_sparse.py), and for lowering compiled kernels on a host without the
    accelerator."""
    return _FORWARD[implementation](q, k, v, seg_q, pos_q, seg_k, pos_k, active, blocks,
                                              **_with_select(implementation, select))


def backward_with_blocks(implementation: str, blocks: ChunkBlocks, q, k, v, seg_q, pos_q,
                         seg_k, pos_k, do, lse, delta, active=True, select=None):
    """chunk_backward counterpart of forward_with_blocks."""
    return _BACKWARD[implementation](q, k, v, seg_q, pos_q, seg_k, pos_k, do, lse,
                                               delta, active, blocks,
                                               **_with_select(implementation, select))


def _check_select(select, q, k, blocks: ChunkBlocks):
    if select is None:
        return None
    shape = (q.shape[0], k.shape[2], blocks.nq, blocks.nk)
    if tuple(jnp.shape(select)) != shape or jnp.asarray(select).dtype != jnp.bool_:
        raise ValueError(f"select must be a bool [B, K, nq, nk]={shape} array (blocks "
                         f"{blocks.bq}x{blocks.bk}), got shape {tuple(jnp.shape(select))} "
                         f"dtype {jnp.asarray(select).dtype}")
    return select


def chunk_forward(q, k, v, seg_q, pos_q, seg_k, pos_k, *, local: bool = False, active=True,
                  implementation: str = "auto", block_q: int | None = None,
                  block_k: int | None = None, interpret: bool | None = None, select=None):
    """(out float32 [B, Lq, H, D], lse float32 [B, Lq, H]) of q against this k/v chunk.
    `select` (Pallas only): bool [B, K, nq, nk], the (query block, key block) pairs of each
    row and kv head to compute at all; the others are SKIP (never computed nor loaded)."""
    _check(q, k, v, seg_q, pos_q, seg_k, pos_k)
    impl, blocks = _setup(q, k, local, implementation, block_q, block_k, interpret)
    return forward_with_blocks(impl, blocks, q, k, v, seg_q, pos_q, seg_k, pos_k, active,
                               _check_select(select, q, k, blocks))


def chunk_backward(q, k, v, seg_q, pos_q, seg_k, pos_k, do, lse, delta, *, local: bool = False,
                   active=True, implementation: str = "auto", block_q: int | None = None,
                   block_k: int | None = None, interpret: bool | None = None, select=None):
    """float32 (dq [B, Lq, H, D], dk, dv [B, Lk, K, D]) of this chunk pair for the output
    cotangent do [B, Lq, H, D], the global lse [B, Lq, H] and delta = rowsum(do * out)
    [B, Lq, H] of the merged output (minus the lse cotangent, if any); `select` as in
    chunk_forward."""
    _check(q, k, v, seg_q, pos_q, seg_k, pos_k)
    B, Lq, H, _ = q.shape
    for name, x, shape in (("do", do, q.shape), ("lse", lse, (B, Lq, H)),
                           ("delta", delta, (B, Lq, H))):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be {tuple(shape)}")
    impl, blocks = _setup(q, k, local, implementation, block_q, block_k, interpret)
    return backward_with_blocks(impl, blocks, q, k, v, seg_q, pos_q, seg_k, pos_k, do, lse,
                                delta, active, _check_select(select, q, k, blocks))


def merge_chunks(out_a, lse_a, out_b, lse_b):
    """The softmax over the union of two chunks' keys from each chunk's (out, lse): out
    [B, L, H, D] float32, lse [B, L, H]. Rows with lse NEG on one side take the other's."""
    lse = jnp.logaddexp(lse_a, lse_b)
    wa, wb = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
    return wa * out_a + wb * out_b, lse


# The op's output and gradients are written in the inputs' dtypes by the kernels themselves
# (float32 arrays and casts were one more pass each; the output's cast was 0.15 s of a 0.7 s
# TPU compile); the backward's delta is rowsum(dO * O) of that output, as FlashAttention-2
# computes it. The ring's rounds keep float32 (forward_with_blocks / backward_with_blocks).
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _chunk(q, k, v, seg_q, pos_q, seg_k, pos_k, impl, blocks):
    return _FORWARD[impl](q, k, v, seg_q, pos_q, seg_k, pos_k, True, blocks, out_dtype=q.dtype)


def _chunk_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k, impl, blocks):
    out, lse = _FORWARD[impl](q, k, v, seg_q, pos_q, seg_k, pos_k, True, blocks, out_dtype=q.dtype)
    return (out, lse), (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _chunk_bwd(impl, blocks, res, cts):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = res
    do, dlse = cts
    # delta = rowsum(dO * out) - dlse (d lse / d s = p), the row sum taken by each backward
    dq, dk, dv = _BACKWARD[impl](q, k, v, seg_q, pos_q, seg_k, pos_k, do, lse, -dlse, True,
                                 blocks, grad_dtype=q.dtype, out=out)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None  # no-ops if alike


_chunk.defvjp(_chunk_fwd, _chunk_bwd)


def attention_chunk(q, k, v, seg_q, pos_q, seg_k, pos_k, *, local: bool = False,
                    implementation: str = "auto", block_q: int | None = None,
                    block_k: int | None = None, interpret: bool | None = None):
    """(out in q's dtype [B, Lq, H, D], lse float32 [B, Lq, H]); differentiable in q, k, v
    (through both outputs). See the module doc for the mask and the arguments."""
    _check(q, k, v, seg_q, pos_q, seg_k, pos_k)
    impl, blocks = _setup(q, k, local, implementation, block_q, block_k, interpret)
    ids = (x.astype(jnp.int32) for x in (seg_q, pos_q, seg_k, pos_k))
    return _chunk(q, k, v, *ids, impl, blocks)
