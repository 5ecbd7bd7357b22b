"""Blocking and block tables of the chunk op (`ops.py`), shared by its XLA and Pallas code.

The chunk op attends a query chunk to one key/value chunk with the mask given per token:
query i sees key j iff seg_q[i] == seg_k[j] and pos_k[j] <= pos_q[i]. Tokens may come in any
order. Ids > 0 are real documents, id 0 is padding, ids < 0 are reserved: the chunk pads its
inputs to whole blocks with Q_FILL / K_FILL, which match nothing.

Work skipping. Each side is cut into blocks (bq queries, bk keys) and summarised per batch row
by the range of its real ids, the range of its real positions, whether it holds padding, and
its raw id / position extremes. A (query block, key block) pair of one row is
  SKIP    nothing allowed between real tokens: the real id ranges are disjoint, or every real
          key comes after every real query (min pos_k > max pos_q), and no padding counts;
  FULL    every entry allowed (one id >= 0 on both sides, max pos_k <= min pos_q);
  PARTIAL otherwise (the exact mask is applied).
Padding (id 0) is kept out of the ranges (it would make every block look reachable). A padding
query needs only a finite output, so padding pairs count only when `local` (the query and key
chunks are the same tokens) and the two blocks share tokens, where each padding query meets
itself: padding costs O(L * block), not O(L^2). Outside that, padding outputs are 0 with lse
= NEG. The rule is conservative for real tokens and tight for packed documents whose blocks
hold contiguous position runs (a zigzag layout keeps them so).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.common import next_pow2, pad_axis, range_of_true

SKIP, FULL, PARTIAL = 0, 1, 2
Q_FILL, K_FILL = -1, -2  # ids of the tokens added up to whole blocks; they match nothing
_BIG = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class ChunkBlocks:
    """Static blocking of one chunk call (hashable: a nondiff argument of custom_vjps).

    Lq / Lk query / key chunk lengths, D head dim, bq / bk block lengths, `local` (the query
    and key chunks are the same tokens), `interpret` (Pallas only)."""

    Lq: int
    Lk: int
    D: int
    bq: int
    bk: int
    local: bool
    interpret: bool = False

    @property
    def nq(self) -> int:
        return -(-self.Lq // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.Lk // self.bk)

    @property
    def Lqp(self) -> int:
        return self.nq * self.bq

    @property
    def Lkp(self) -> int:
        return self.nk * self.bk

    @property
    def Dp(self) -> int:
        """Head dim padded for the Pallas kernels (power of two >= 16: Triton dot sizes)."""
        return max(16, next_pow2(self.D))

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.D)


def make_chunk_blocks(Lq: int, Lk: int, D: int, block_q: int, block_k: int, local: bool,
                      pallas: bool, interpret: bool = False,
                      mosaic: bool = False) -> ChunkBlocks:
    """XLA: blocks clamped to the chunk lengths. Pallas on GPU (Triton): clamped to the next
    power of two >= the length (>= 16), and compiled it needs powers of two >= 16. Pallas on
    TPU (`mosaic`): multiples of 128, clamped to the length rounded up to 128."""
    if local and Lq != Lk:
        raise ValueError(f"local=True means q and k are the same tokens, but {Lq=} != {Lk=}")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"{name}={b!r} must be a positive int")
    if not pallas:
        return ChunkBlocks(Lq, Lk, D, min(block_q, Lq), min(block_k, Lk), bool(local))
    if mosaic:
        for name, b in (("block_q", block_q), ("block_k", block_k)):
            if b % 128:
                raise ValueError(f"{name}={b} must be a multiple of 128 for the Mosaic (TPU) "
                                 f"kernels ({Lq=}, {Lk=})")
        bq, bk = (min(b, -(-n // 128) * 128) for b, n in ((block_q, Lq), (block_k, Lk)))
        return ChunkBlocks(Lq, Lk, D, bq, bk, bool(local), bool(interpret))
    bq = min(block_q, max(16, next_pow2(Lq)))
    bk = min(block_k, max(16, next_pow2(Lk)))
    if not interpret:
        for name, b in (("block_q", bq), ("block_k", bk)):
            if b & (b - 1) or b < 16:
                raise ValueError(f"{name}={b} must be a power of two >= 16 for compiled Pallas "
                                 f"(got {block_q=}, {block_k=}, {Lq=}, {Lk=})")
    return ChunkBlocks(Lq, Lk, D, bq, bk, bool(local), bool(interpret))


def pad_ids(seg_BxL, pos_BxL, n: int, fill: int):
    """int32 ids and positions padded to n tokens with id `fill` (position 0)."""
    seg = pad_axis(seg_BxL.astype(jnp.int32), 1, n, value=fill)
    pos = pad_axis(pos_BxL.astype(jnp.int32), 1, n, value=0)
    return seg, pos


def block_summaries(seg_BxL, pos_BxL, b: int) -> dict[str, jax.Array]:
    """Per row and block of b tokens ([B, n] each): real (id > 0) id range slo..shi, real
    position range plo..phi, whether it holds padding (id 0), raw id / position extremes."""
    B, L = seg_BxL.shape
    seg = seg_BxL.reshape(B, L // b, b)
    pos = pos_BxL.reshape(B, L // b, b)
    real = seg > 0
    return dict(
        slo=jnp.where(real, seg, _BIG).min(-1),
        shi=jnp.where(real, seg, -_BIG).max(-1),
        plo=jnp.where(real, pos, _BIG).min(-1),
        phi=jnp.where(real, pos, -_BIG).max(-1),
        pad=(seg == 0).any(-1),
        smin=seg.min(-1),
        smax=seg.max(-1),
        pmin=pos.min(-1),
        pmax=pos.max(-1),
    )


def _sharing_tokens(nq: int, bq: int, nk: int, bk: int) -> np.ndarray:
    """[nq, nk] bool: query block i and key block j cover a common token index."""
    qi = np.arange(nq)[:, None]
    kj = np.arange(nk)[None, :]
    return (qi * bq < (kj + 1) * bk) & (kj * bk < (qi + 1) * bq)


def pair_flags(sum_q, sum_k, bq: int, bk: int, local: bool):
    """(allowed, full), each [B, nq, nk] bool, from `block_summaries` of both sides:
    `allowed` = the pair must be computed, `full` = every entry of the pair is allowed."""
    q = {n: x[:, :, None] for n, x in sum_q.items()}  # [B, nq, 1]
    k = {n: x[:, None, :] for n, x in sum_k.items()}  # [B, 1, nk]
    allowed = (jnp.maximum(q["slo"], k["slo"]) <= jnp.minimum(q["shi"], k["shi"])) & (
        k["plo"] <= q["phi"])
    if local:
        nq, nk = sum_q["pad"].shape[1], sum_k["pad"].shape[1]
        shared = jnp.asarray(_sharing_tokens(nq, bq, nk, bk))[None]
        allowed |= q["pad"] & k["pad"] & shared
    full = (q["smin"] == q["smax"]) & (k["smin"] == k["smax"]) & (q["smin"] == k["smin"])
    full &= (q["smin"] >= 0) & (k["pmax"] <= q["pmin"])
    return allowed, full


def row_kinds(allowed, full, active=True) -> jax.Array:
    """[B, nq, nk] int32 SKIP / FULL / PARTIAL per batch row; all SKIP unless `active`."""
    kinds = jnp.where(allowed, jnp.where(full, FULL, PARTIAL), SKIP)
    return jnp.where(active, kinds, SKIP).astype(jnp.int32)


def shared_kinds(allowed, full, active=True) -> jax.Array:
    """[nq, nk] int32 table shared by the batch: SKIP iff no row needs the pair, FULL iff
    every row's pair is entirely allowed (a FULL row that is skipped is still all allowed)."""
    kinds = jnp.where(allowed.any(0), jnp.where(full.all(0), FULL, PARTIAL), SKIP)
    return jnp.where(active, kinds, SKIP).astype(jnp.int32)


def visit_ranges(kinds_BxNxM) -> jax.Array:
    """[B, N, 2] int32: [first, last + 1) of the non-SKIP entries on the last axis; [0, 0) if
    none. The Pallas kernels loop over this range only."""
    return range_of_true(kinds_BxNxM != SKIP)


def output_delta(do, out, delta):
    """float32 [B, L, H]: delta plus rowsum(dO * out) when the chunk's own output `out`
    [B, L, H, D] is given (the chunk op's vjp passes it with minus its lse cotangent), else
    delta (the ring's, of its merged output). The Mosaic kernels take `out` themselves."""
    if out is None:
        return delta
    return delta + (do.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)
