"""Ring attention over groups of devices, masked by (segment id, position) only.

`ring_attention` runs inside `jax.shard_map` over a 1-D mesh axis `axis_name` of N devices,
partitioned by the static `groups = ((start, degree), ...)` into contiguous rings that tile
0..N-1 in order. Each device holds T tokens of its group's token stream, in any order: a query
attends a key iff both are in the same group, seg_q == seg_k and pos_k <= pos_q. Nothing here
depends on where a token sits, so the caller is free to balance work with a zigzag layout
(`jaxsb.plan.layout.zigzag_layout`).

The ring algorithm is written once; the work of one round, attention of the device's query
shard to the visiting key/value shard, is one call of the chunk op
`kernels_pallas.ring_chunk` (`chunk_forward` / `chunk_backward`, called through
`forward_with_blocks` / `backward_with_blocks` with the implementation resolved once), whose
`implementation` is "xla" (blocked jnp + lax loops, any backend) or "pallas" (Pallas kernels:
Triton on GPU, Mosaic on TPU (resolved to "mosaic"), the interpreter on a CPU host);
ring_attention's "auto" is Pallas on GPU and
XLA elsewhere (kernels_pallas.common.resolve_implementation).

Forward. In round r = 0 .. max_degree-1 a device attends its q shard to the kv shard of ring
rank (rank - r) mod degree, round 0 being its own. While it computes, one `lax.ppermute`
(the union of one cycle per ring that has a round r+1; the other rings are left out and send
nothing) already moves the kv shards one step on, so the transfer can overlap the compute.
Each round's chunk returns its own output and log-sum-exp (float32); `merge_chunks` folds it
into the running (out, lse), which is the softmax over all keys seen so far. The forward
saves the final lse.

Backward (`jax.custom_vjp`, FlashAttention-2 style). The kv shards make the same trip again;
each round `chunk_backward` recomputes the probabilities from q, k and the saved global lse
and delta = rowsum(dO * O), a device adds the dQ part to its own float32 dQ and the dK|dV part
to the visiting shard's float32 dK|dV accumulator, then passes the accumulator on (a second
ppermute per round, after the compute that updates it). A ring of degree d passes it d times,
which brings it back to its owner.

A device whose ring has no round r is idle: it calls the chunk with active=False (every block
pair SKIP, nothing added) and keeps its accumulator; no collective sits under a conditional.
Rounds with the same permutations run as one `lax.scan`, so compile time grows with the
number of distinct degrees, not max_degree. Buffers per round: k|v packed [B,T,2K,D] in the
input dtype with (seg, pos) packed [B,T,2] in one ppermute call, and dK|dV packed (float32)
in the other.

Inside one round the chunk op blocks its inputs and classifies each (query block, key block)
pair from per-block (segment id, position) ranges as SKIP / FULL / PARTIAL
(kernels_pallas/ring_chunk/tables.py): skipped pairs are never computed, FULL
pairs need no mask. Padding (id 0) is kept out of the ranges; a padding query only needs a
finite output, so padding pairs count only in round 0 where the two blocks share tokens:
padding costs O(T * block), not O(T^2). Ranges are conservative but tight for packed documents
whose blocks hold contiguous position runs, which is what makes the zigzag layout balanced
(`ring_block_counts` counts the non-skipped pairs of a device under the XLA blocking).

T need not be a multiple of `block`: the chunk op pads with fill tokens whose segment ids
(-1 for queries, -2 for keys) match nothing.

Pallas under shard_map: compiled kernels carry the inputs' varying mesh axes on their
out_shapes (check_vma=True works); JAX 0.10's Pallas interpreter does not track them, so an
interpreted ring (implementation="pallas" on a CPU host) needs shard_map(check_vma=False), as
the executor uses, and says so otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxsb.parallel.ring_loop import RingConfig, axis_size, check_groups, ring_config, ring_loop, vma_full
from kernels_pallas.common import NEG
from kernels_pallas.ring_chunk import tables
from kernels_pallas.ring_chunk.ops import backward_with_blocks, forward_with_blocks, merge_chunks
from kernels_pallas.ring_chunk.tables import (FULL, PARTIAL, SKIP, ChunkBlocks,
                                              make_chunk_blocks)

__all__ = ["FULL", "PARTIAL", "SKIP", "block_kinds", "ring_attention", "ring_block_counts"]


# ----------------------------------------------------------------------------- block tables


def _ids_tokens(x_nxBxb):
    """Blocked [n, B, b] -> [B, n * b]."""
    n, B, b = x_nxBxb.shape
    return x_nxBxb.transpose(1, 0, 2).reshape(B, n * b)


def block_kinds(seg_q, pos_q, seg_k, pos_k, local: bool = True) -> jax.Array:
    """[nq, nk] int32 SKIP / FULL / PARTIAL for blocked [n, B, b] query and key ids/positions,
    shared by the batch as the XLA chunk uses it (tables.shared_kinds).

    SKIP needs every row to be empty, FULL every row to be full. Conservative for real tokens:
    SKIP implies no allowed entry with id > 0 (such a pair has equal ids inside both ranges and
    min pos_k <= pos_k <= pos_q <= max pos_q); FULL implies every entry allowed. Padding
    queries only need some key: padding pairs count only on the diagonal of the local shard
    (`local`, the same tokens on both sides), where every padding query meets itself.
    """
    b = seg_q.shape[2]
    sq, pq, sk, pk = (_ids_tokens(jnp.asarray(x, jnp.int32)) for x in (seg_q, pos_q, seg_k, pos_k))
    allowed, full = tables.pair_flags(tables.block_summaries(sq, pq, b),
                                      tables.block_summaries(sk, pk, seg_k.shape[2]),
                                      b, seg_k.shape[2], local)
    return tables.shared_kinds(allowed, full)


# ----------------------------------------------------------------------------- rounds


def _chunk_blocks(cfg: RingConfig, q, local: bool) -> ChunkBlocks:
    """The chunk blocking of one round (q and the visiting k/v shard have T tokens each)."""
    T, D = q.shape[1], q.shape[3]
    return make_chunk_blocks(T, T, D, cfg.block, cfg.block, local,
                             pallas=cfg.implementation != "xla", interpret=cfg.interpret,
                             mosaic=cfg.implementation == "mosaic")


def _ride(k, v, seg, pos):
    """What travels around the ring: k|v packed [B,T,2K,D] and (seg, pos) packed [B,T,2]."""
    return jnp.concatenate([k, v], axis=2), jnp.stack([seg, pos], axis=-1)


def _unride(ride, seg_q, pos_q):
    """The chunk op's (k, v, seg_q, pos_q, seg_k, pos_k) from a ride and the local ids."""
    kv, sp = ride
    K = kv.shape[2] // 2
    return kv[:, :, :K], kv[:, :, K:], seg_q, pos_q, sp[..., 0], sp[..., 1]


def _ring_forward(q, k, v, seg, pos, cfg: RingConfig):
    """(out in q's dtype, lse float32 [B,T,H]) of the whole ring."""

    def step(active, local, ride, _, state):
        out_r, lse_r = forward_with_blocks(cfg.implementation, _chunk_blocks(cfg, q, local), q,
                                           *_unride(ride, seg, pos), active)
        return None, merge_chunks(*state, out_r, lse_r)

    state = (vma_full(q, q.shape), vma_full(q, q.shape[:3], NEG))
    _, (out, lse) = ring_loop(cfg, step, _ride(k, v, seg, pos), None, state)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, seg, pos, cfg):
    return _ring_forward(q, k, v, seg, pos, cfg)[0]


def _ring_fwd(q, k, v, seg, pos, cfg):
    out, lse = _ring_forward(q, k, v, seg, pos, cfg)
    return out, (q, k, v, seg, pos, out, lse)


def _ring_bwd(cfg: RingConfig, res, do):
    q, k, v, seg, pos, out, lse = res
    B, T, K, D = k.shape
    delta = (do.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)  # rowsum(dO * O)

    def step(active, local, ride, dkv, dq):
        dq_r, dk_r, dv_r = backward_with_blocks(cfg.implementation, _chunk_blocks(cfg, q, local), q,
                                                *_unride(ride, seg, pos), do, lse, delta,
                                                active)
        return dkv + jnp.concatenate([dk_r, dv_r], axis=2), dq + dq_r

    dkv, dq = ring_loop(cfg, step, _ride(k, v, seg, pos), vma_full(k, (B, T, 2 * K, D)),
                        vma_full(q, q.shape))  # dkv is home
    return (dq.astype(q.dtype), dkv[:, :, :K].astype(k.dtype), dkv[:, :, K:].astype(v.dtype),
            None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- public


def ring_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxKxD: jax.Array,
    v_BxTxKxD: jax.Array,
    seg_BxT: jax.Array,
    pos_BxT: jax.Array,
    *,
    axis_name: str,
    groups: tuple[tuple[int, int], ...],
    block: int = 256,
    implementation: str = "auto",
    interpret: bool | None = None,
) -> jax.Array:
    """Causal document attention over ring groups; call inside shard_map over `axis_name`.

    q [B,T,H,D], k/v [B,T,K,D] (this device's T tokens, any order; H % K == 0, query head h
    reads kv head h // (H//K)), seg/pos [B,T] int segment ids (0 = padding, real ids > 0 and
    unique per document within a group) and positions. `groups` = ((start, degree), ...)
    tiles the axis. Returns [B,T,H,D] in q's dtype; differentiable (ring backward).
    Padding outputs are finite but arbitrary (they attend only part of the padding).

    `block`: query and key block length of each round's chunk (clamped to T; compiled Pallas
    needs a power of two >= 16 on GPU, a multiple of 128 on TPU). `implementation`: "xla" | "pallas" | "auto" (Pallas on GPU,
    XLA elsewhere; see kernels_pallas.ring_chunk); `interpret` (Pallas only): None =
    the Pallas interpreter iff the backend is CPU. The interpreter needs
    shard_map(check_vma=False) (module doc).
    Note (JAX semantics, not this function): under shard_map(check_vma=False), jax.grad taken
    inside the body of a psum'd loss comes out N times too large (psum transposes to psum);
    differentiate outside the shard_map, or keep check_vma=True.
    """
    cfg = ring_config(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, seg_BxT, pos_BxT, axis_name, groups, block,
                      implementation, interpret)
    seg = seg_BxT.astype(jnp.int32)
    pos = pos_BxT.astype(jnp.int32)
    return _ring(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, seg, pos, cfg)


def ring_block_counts(seg_BxT, pos_BxT, *, axis_name: str, groups, block: int = 256) -> jax.Array:
    """int32 scalar: (query block, key block) pairs this device computes in the forward under
    the XLA chunk's blocking (block x block, table shared by the batch), summed over all
    rounds (the backward visits the same pairs). Call inside shard_map."""
    B, T = seg_BxT.shape
    cfg = RingConfig(axis_name, check_groups(groups, axis_size(axis_name)), min(block, T))
    b = cfg.block
    Tp = -(-T // b) * b
    sq, pq = tables.pad_ids(seg_BxT, pos_BxT, Tp, tables.Q_FILL)
    sum_q = tables.block_summaries(sq, pq, b)

    def step(active, local, sp_k, _, count):
        sk, pk = tables.pad_ids(sp_k[..., 0], sp_k[..., 1], Tp, tables.K_FILL)
        allowed, full = tables.pair_flags(sum_q, tables.block_summaries(sk, pk, b), b, b, local)
        kinds = tables.shared_kinds(allowed, full, active)
        return None, count + (kinds != SKIP).sum(dtype=jnp.int32)

    sp = jnp.stack([seg_BxT.astype(jnp.int32), pos_BxT.astype(jnp.int32)], axis=-1)
    return ring_loop(cfg, step, sp, None, lax.full_like(sq, 0, jnp.int32, ()))[1]
