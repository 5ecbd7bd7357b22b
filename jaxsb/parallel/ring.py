"""Ring attention over groups of devices, masked by (segment id, position) only.

`ring_attention` runs inside `jax.shard_map` over a 1-D mesh axis `axis_name` of N devices,
partitioned by the static `groups = ((start, degree), ...)` into contiguous rings that tile
0..N-1 in order. Each device holds T tokens of its group's token stream, in any order: a query
attends a key iff both are in the same group, seg_q == seg_k and pos_k <= pos_q. Nothing here
depends on where a token sits, so the caller is free to balance work with a zigzag layout
(`zigzag_layout`).

Forward. In round r = 0 .. max_degree-1 a device attends its q shard to the kv shard of ring
rank (rank - r) mod degree, round 0 being its own. While it computes, one `lax.ppermute`
(the union of one cycle per ring that has a round r+1; the other rings are left out and send
nothing) already moves the kv shards one step on, so the transfer can overlap the compute.
The online softmax (running max m, sum l, accumulator acc, all float32) simply continues
across rounds; the forward saves the per-query log-sum-exp.

Backward (`jax.custom_vjp`, FlashAttention-2 style). The kv shards make the same trip again;
each round a device adds its queries' contribution to its own dQ and to the visiting shard's
float32 dK|dV accumulator, recomputing the probabilities from q, k and the saved
log-sum-exp, then passes the accumulator on (a second ppermute per round, after the compute
that updates it). A ring of degree d passes it d times, which brings it back to its owner.

A device whose ring has no round r is idle: its block table is forced to SKIP and it keeps its
accumulator; no collective sits under a conditional. Rounds with the same permutations run as
one `lax.scan`, so compile time grows with the number of distinct degrees, not max_degree.
Buffers per round: k|v packed [B,T,2K,D] in the input dtype with (seg, pos) packed [B,T,2]
in one ppermute call, and dK|dV packed (float32) in the other.

Inside one (q shard, kv shard) pair the work is blocked (`block` tokens per block) and each
(query block, key block) pair is classified from per-block summaries as
  SKIP    no allowed entry between real tokens: real (id > 0) segment ranges disjoint, or
          every real key after every real query (min pos_k > max pos_q);
  FULL    every entry allowed (one segment id on both sides, max pos_k <= min pos_q);
  PARTIAL otherwise (the exact (seg, pos) mask is applied).
Padding (id 0) is kept out of the ranges (it would make every block look reachable). A
padding query only needs a finite output, so padding pairs count only on the diagonal of the
local shard (round 0), where each padding query meets at least itself: padding costs
O(T * block), not O(T^2). Ranges are conservative but tight for packed documents whose blocks
hold contiguous position runs, which is what makes the zigzag layout balanced
(`ring_block_counts` counts the non-skipped pairs of a device, for tests and planning).

T need not be a multiple of `block`: the shard is padded with fill tokens whose segment ids
(-1 for queries, -2 for keys) match nothing.

Layouts inside: q blocks [nq, B, K, G, bq, D] (query head h = kv_head * G + g), k/v blocks
[nk, B, K, bk, D]; all arithmetic float32, results cast back to the input dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas.common import HI, NEG, check_qkv

SKIP, FULL, PARTIAL = 0, 1, 2
_Q_FILL, _K_FILL = -1, -2  # segment ids of the padding added up to whole blocks
_BIG = np.iinfo(np.int32).max


# ----------------------------------------------------------------------------- layout


def zigzag_layout(num_tokens: int, degree: int) -> np.ndarray:
    """[degree, 2*c] int64 indices into a group's token stream, row r = rank r's tokens.

    The stream is padded to P = a multiple of 2*degree and cut into 2*degree chunks of
    c = P / (2*degree); rank r gets chunks r and 2*degree-1-r, so each rank holds one early
    and one late chunk and causal work is balanced. Indices >= num_tokens are padding.
    """
    if num_tokens < 1 or degree < 1:
        raise ValueError(f"{num_tokens=} and {degree=} must be positive")
    c = -(-num_tokens // (2 * degree))
    ranks = np.arange(degree)[:, None]
    offsets = np.arange(c)[None, :]
    return np.concatenate([ranks * c + offsets, (2 * degree - 1 - ranks) * c + offsets], axis=1)


# ----------------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static description of one call: the mesh axis, its groups and the block size."""

    axis_name: str
    groups: tuple[tuple[int, int], ...]
    block: int

    @property
    def max_degree(self) -> int:
        return max(d for _, d in self.groups)

    def degrees(self) -> np.ndarray:
        """[N] int32: the degree of each device's group."""
        return np.concatenate([np.full(d, d, np.int32) for _, d in self.groups])

    def phases(self) -> list[tuple[int, int]]:
        """Runs [lo, hi) of the middle rounds 1 .. max_degree-2 that use the same two
        permutations (rings of degree >= r + 2 prefetch, rings of degree >= r + 1 computed)."""
        runs: list[list[int]] = []
        for r in range(1, self.max_degree - 1):
            key = (self.shift_perm(r + 2), self.shift_perm(r + 1))
            if runs and (self.shift_perm(runs[-1][0] + 2), self.shift_perm(runs[-1][0] + 1)) == key:
                runs[-1][1] = r + 1
            else:
                runs.append([r, r + 1])
        return [(lo, hi) for lo, hi in runs]

    def shift_perm(self, min_degree: int) -> list[tuple[int, int]]:
        """One step along every ring of degree >= min_degree (rank j -> j+1 mod degree)."""
        return [
            (s + j, s + (j + 1) % d) for s, d in self.groups if d >= min_degree for j in range(d)
        ]


def check_groups(groups, num_devices: int | None = None) -> tuple[tuple[int, int], ...]:
    """Normalised groups; they must tile 0..num_devices-1 contiguously in order."""
    try:
        groups = tuple((int(s), int(d)) for s, d in groups)
    except (TypeError, ValueError) as e:
        raise ValueError(f"groups={groups!r} must be a tuple of (start, degree) pairs") from e
    if not groups:
        raise ValueError("groups must not be empty")
    expect = 0
    for s, d in groups:
        if d < 1:
            raise ValueError(f"group (start={s}, degree={d}) must have degree >= 1; {groups=}")
        if s != expect:
            raise ValueError(f"group (start={s}, degree={d}) must start at {expect}: groups "
                             f"tile the axis contiguously in order; {groups=}")
        expect = s + d
    if num_devices is not None and expect != num_devices:
        raise ValueError(f"groups cover {expect} devices but the axis has {num_devices}; {groups=}")
    return groups


def _axis_size(axis_name) -> int:
    if hasattr(lax, "axis_size"):
        return lax.axis_size(axis_name)
    return lax.psum(1, axis_name)


def _my_degree(cfg: RingConfig):
    """This device's group degree (traced scalar), from the axis index and a static table."""
    return jnp.asarray(cfg.degrees())[lax.axis_index(cfg.axis_name)]


def _full(ref, shape, value=0.0):
    """float32 constant of `shape` that varies over the same manual mesh axes as `ref`.

    Constants made inside shard_map (initial carries, zero blocks) would otherwise be
    replicated while everything computed from the inputs varies, and loop carries and switch
    branches must agree; `lax.full_like` carries ref's varying axes over (check_vma=True)."""
    return lax.full_like(ref, value, jnp.float32, shape)


# ----------------------------------------------------------------------------- blocks


def _pad_t(x, n, value):
    if x.shape[1] == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, n - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def _summaries(seg_NxBxb, pos_NxBxb):
    """Per block and row: real (id > 0) segment range, real position range, has padding,
    and the raw segment / position extremes (for FULL)."""
    real = seg_NxBxb > 0
    return dict(
        slo=jnp.where(real, seg_NxBxb, _BIG).min(-1),
        shi=jnp.where(real, seg_NxBxb, -_BIG).max(-1),
        plo=jnp.where(real, pos_NxBxb, _BIG).min(-1),
        phi=jnp.where(real, pos_NxBxb, -_BIG).max(-1),
        pad=(seg_NxBxb == 0).any(-1),
        smin=seg_NxBxb.min(-1),
        smax=seg_NxBxb.max(-1),
        pmin=pos_NxBxb.min(-1),
        pmax=pos_NxBxb.max(-1),
    )


def block_kinds(seg_q, pos_q, seg_k, pos_k, local: bool = True) -> jax.Array:
    """[nq, nk] int32 SKIP / FULL / PARTIAL for blocked [n, B, b] query and key ids/positions.

    SKIP needs every row to be empty, FULL every row to be full (the table is shared by the
    batch). Conservative for real tokens: SKIP implies no allowed entry with id > 0 (such a
    pair has equal ids inside both ranges and min pos_k <= pos_k <= pos_q <= max pos_q); FULL
    implies every entry allowed. Padding queries only need some key (their outputs are
    ignored): padding pairs count only on the diagonal of the local shard (`local`, the same
    tokens on both sides), where every padding query meets itself, so padding costs
    O(T * block) instead of O(T^2) per group.
    """
    q = {n: x[:, None] for n, x in _summaries(seg_q, pos_q).items()}  # [nq, 1, B]
    k = {n: x[None, :] for n, x in _summaries(seg_k, pos_k).items()}  # [1, nk, B]
    real = (jnp.maximum(q["slo"], k["slo"]) <= jnp.minimum(q["shi"], k["shi"])) & (
        k["plo"] <= q["phi"])
    any_allowed = real.any(-1)
    if local:
        pad = (q["pad"] & k["pad"]).any(-1)
        any_allowed |= pad & jnp.eye(*pad.shape, dtype=bool)
    full = (q["smin"] == q["smax"]) & (k["smin"] == k["smax"]) & (q["smin"] == k["smin"])
    full &= (q["smin"] >= 0) & (k["pmax"] <= q["pmin"])
    all_allowed = full.all(-1)
    return jnp.where(any_allowed, jnp.where(all_allowed, FULL, PARTIAL), SKIP).astype(jnp.int32)


def _round_kinds(sq, pq, sk, pk, active, local: bool):
    """The block table of one round: all SKIP on a device whose ring is exhausted."""
    return jnp.where(active, block_kinds(sq, pq, sk, pk, local), SKIP)


def _pair_mask(sq_Bxbq, pq_Bxbq, sk_Bxbk, pk_Bxbk):
    """[B, 1, 1, bq, bk] exact mask of one block pair."""
    same_doc = sq_Bxbq[:, :, None] == sk_Bxbk[:, None, :]
    causal = pk_Bxbk[:, None, :] <= pq_Bxbq[:, :, None]
    return (same_doc & causal)[:, None, None]


def _blocks_tokens(x_BxTp, b):
    """[B, Tp] -> [n, B, b]."""
    B, Tp = x_BxTp.shape
    return x_BxTp.reshape(B, Tp // b, b).transpose(1, 0, 2)


def _q_blocks(x_BxTpxHxD, K, b):
    """[B, Tp, H, D] -> float32 [nq, B, K, G, b, D]."""
    B, Tp, H, D = x_BxTpxHxD.shape
    x = x_BxTpxHxD.astype(jnp.float32).reshape(B, Tp // b, b, K, H // K, D)
    return x.transpose(1, 0, 3, 4, 2, 5)


def _from_q_blocks(x_nxBxKxGxbxD, T):
    n, B, K, G, b, D = x_nxBxKxGxbxD.shape
    return x_nxBxKxGxbxD.transpose(1, 0, 4, 2, 3, 5).reshape(B, n * b, K * G, D)[:, :T]


def _kv_blocks(kv_BxTpx2KxD, b):
    """Packed [B, Tp, 2K, D] -> float32 k and v blocks [nk, B, K, b, D]."""
    B, Tp, K2, D = kv_BxTpx2KxD.shape
    x = kv_BxTpx2KxD.astype(jnp.float32).reshape(B, Tp // b, b, K2, D).transpose(1, 0, 3, 2, 4)
    return x[:, :, : K2 // 2], x[:, :, K2 // 2 :]


def _from_kv_blocks(x_nxBxKxbxD, T):
    n, B, K, b, D = x_nxBxKxbxD.shape
    return x_nxBxKxbxD.transpose(1, 0, 3, 2, 4).reshape(B, n * b, K, D)[:, :T]


# ----------------------------------------------------------------------------- pair kernels


def _fwd_pair(qb, sq, pq, kb_all, vb_all, sk, pk, kinds, state):
    """Continue the online softmax of every query block over one kv shard.

    qb [nq,B,K,G,bq,D] (scaled), sq/pq [nq,B,bq]; kb_all/vb_all [nk,B,K,bk,D], sk/pk [nk,B,bk];
    kinds [nq,nk]; state (m, l [nq,B,K,G,bq], acc [nq,B,K,G,bq,D])."""
    nk = kb_all.shape[0]

    def q_block(_, xs):
        q_b, sq_b, pq_b, kinds_row, m, l, acc = xs

        def update(carry, ki, masked):
            m, l, acc = carry
            s = jnp.einsum("bkgqd,bksd->bkgqs", q_b, kb_all[ki], precision=HI)
            if masked:
                s = jnp.where(_pair_mask(sq_b, pq_b, sk[ki], pk[ki]), s, NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(-1)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p, vb_all[ki], precision=HI)
            acc = alpha[..., None] * acc + pv
            return m_new, l, acc

        def k_step(ki, carry):
            return lax.switch(
                kinds_row[ki],
                [
                    lambda c: c,
                    functools.partial(update, ki=ki, masked=False),
                    functools.partial(update, ki=ki, masked=True),
                ],
                carry,
            )

        return None, lax.fori_loop(0, nk, k_step, (m, l, acc))

    _, state = lax.scan(q_block, None, (qb, sq, pq, kinds, *state))
    return state


def _bwd_pair(qb, sq, pq, dob, lse, delta, kb_all, vb_all, sk, pk, kinds, dq, dkv):
    """Add one kv shard's share to dq [nq,B,K,G,bq,D] and this shard's packed dk|dv
    [nk,B,2K,bk,D]."""
    nq, K = qb.shape[0], kb_all.shape[2]
    zeros_dq_b = _full(dq, qb.shape[1:])

    def k_block(dq, xs):
        k_b, v_b, sk_b, pk_b, kinds_col, dkv_b = xs

        def update(carry, qi, masked):
            dk_b, dv_b = carry
            q_b = qb[qi]
            do_b = dob[qi]
            s = jnp.einsum("bkgqd,bksd->bkgqs", q_b, k_b, precision=HI)
            if masked:
                s = jnp.where(_pair_mask(sq[qi], pq[qi], sk_b, pk_b), s, NEG)
            p = jnp.exp(s - lse[qi][..., None])  # masked: exp(NEG - lse) == 0
            dv_b = dv_b + jnp.einsum("bkgqs,bkgqd->bksd", p, do_b, precision=HI)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", do_b, v_b, precision=HI)
            ds = p * (dp - delta[qi][..., None])
            dk_b = dk_b + jnp.einsum("bkgqs,bkgqd->bksd", ds, q_b, precision=HI)  # q holds scale
            return (dk_b, dv_b), jnp.einsum("bkgqs,bksd->bkgqd", ds, k_b, precision=HI)

        def q_step(qi, carry):
            dq, dkv = carry
            # dq stays outside the switch so the branches never copy the whole array.
            dkv, dq_b = lax.switch(
                kinds_col[qi],
                [
                    lambda c: (c, zeros_dq_b),
                    functools.partial(update, qi=qi, masked=False),
                    functools.partial(update, qi=qi, masked=True),
                ],
                dkv,
            )
            return dq.at[qi].add(dq_b), dkv

        dq, (dk_b, dv_b) = lax.fori_loop(0, nq, q_step, (dq, (dkv_b[:, :K], dkv_b[:, K:])))
        return dq, jnp.concatenate([dk_b, dv_b], axis=1)

    return lax.scan(k_block, dq, (kb_all, vb_all, sk, pk, kinds.T, dkv))


# ----------------------------------------------------------------------------- ring


def _prepare(q, k, v, seg, pos, cfg: RingConfig):
    """Padded shards: q [B,Tp,H,D], kv packed [B,Tp,2K,D], query and key (seg, pos) [B,Tp,2]."""
    T = q.shape[1]
    b = cfg.block
    Tp = -(-T // b) * b
    q = _pad_t(q, Tp, 0)
    kv = _pad_t(jnp.concatenate([k, v], axis=2), Tp, 0)
    sp = jnp.stack([seg, pos], axis=-1)
    sp_q = _pad_t(sp, Tp, _Q_FILL)
    sp_k = _pad_t(sp, Tp, _K_FILL)
    return q, kv, sp_q, sp_k


def _shift(x, cfg: RingConfig, min_degree: int):
    return lax.ppermute(x, cfg.axis_name, cfg.shift_perm(min_degree))


def _ring_round(cfg: RingConfig, step, r, local: bool, last: bool, ride, acc, carry):
    """One round: prefetch the next round's `ride` (async with the compute that follows, which
    reads the current one), run step, then pass `acc` on along the rings that computed."""
    degree = _my_degree(cfg)
    nxt = ride if last else _shift(ride, cfg, r + 2)  # rings with a round r + 1
    acc, carry = step(degree > r, local, ride, acc, carry)
    sent = max(2, r + 1)  # rings that computed in round r (degree 1 has nowhere to go)
    if acc is not None and cfg.shift_perm(sent):
        moved = _shift(acc, cfg, sent)
        acc = jax.tree.map(lambda new, old: jnp.where(degree >= sent, new, old), moved, acc)
    return nxt, acc, carry


def _ring_loop(cfg: RingConfig, step, ride, acc, carry):
    """Rounds r = 0 .. max_degree-1; in round r a device holds `ride` (and `acc`) of ring rank
    (rank - r) mod degree. step(active, local, ride, acc, carry) -> (acc, carry); `active`
    (traced bool) is False on devices whose ring has no round r (the step must not add
    anything; their `acc` stays put); `local` (static) is True in round 0 only.

    `ride` (read-only: k, v, ids) moves before the compute that does not need it, so the
    transfer can overlap; `acc` (updated by step: dK, dV) moves after it. A ring of degree d
    shifts `acc` d times in total, which brings it back to its owner. The middle rounds run as
    lax.scans over runs of rounds with the same permutations, so the step is traced a handful
    of times (3 for equal degrees), not max_degree times. Returns (acc, carry).
    """
    R = cfg.max_degree
    ride, acc, carry = _ring_round(cfg, step, 0, True, R == 1, ride, acc, carry)
    for lo, hi in cfg.phases():

        def body(c, r, lo=lo):
            # The permutations are those of round lo throughout the run; r only gates compute.
            degree = _my_degree(cfg)
            ride, acc, carry = c
            nxt = _shift(ride, cfg, lo + 2)
            acc, carry = step(degree > r, False, ride, acc, carry)
            if acc is not None:
                moved = _shift(acc, cfg, lo + 1)
                acc = jax.tree.map(lambda new, old: jnp.where(degree > r, new, old), moved, acc)
            return (nxt, acc, carry), None

        (ride, acc, carry), _ = lax.scan(
            body, (ride, acc, carry), jnp.arange(lo, hi, dtype=jnp.int32))
    if R > 1:
        _, acc, carry = _ring_round(cfg, step, R - 1, False, True, ride, acc, carry)
    return acc, carry


def _key_blocks(kv, sp_k, b):
    kb_all, vb_all = _kv_blocks(kv, b)
    return kb_all, vb_all, _blocks_tokens(sp_k[..., 0], b), _blocks_tokens(sp_k[..., 1], b)


def _ring_forward(q, k, v, seg, pos, cfg: RingConfig):
    T, D = q.shape[1], q.shape[3]
    K = k.shape[2]
    b = cfg.block
    qp, kv, sp_q, sp_k = _prepare(q, k, v, seg, pos, cfg)
    qb = _q_blocks(qp, K, b) * (1.0 / math.sqrt(D))
    sq, pq = _blocks_tokens(sp_q[..., 0], b), _blocks_tokens(sp_q[..., 1], b)

    def step(active, local, ride, _, state):
        kb_all, vb_all, sk, pk = _key_blocks(*ride, b)
        kinds = _round_kinds(sq, pq, sk, pk, active, local)
        return None, _fwd_pair(qb, sq, pq, kb_all, vb_all, sk, pk, kinds, state)

    state = (_full(qb, qb.shape[:-1], NEG), _full(qb, qb.shape[:-1]), _full(qb, qb.shape))
    _, (m, l, acc) = _ring_loop(cfg, step, (kv, sp_k), None, state)
    # Every real or padding query sees itself in round 0, so l > 0 there; fill rows may not.
    l = jnp.where(l == 0.0, 1.0, l)
    out = _from_q_blocks(acc / l[..., None], T).astype(q.dtype)
    return out, m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, seg, pos, cfg):
    return _ring_forward(q, k, v, seg, pos, cfg)[0]


def _ring_fwd(q, k, v, seg, pos, cfg):
    out, lse = _ring_forward(q, k, v, seg, pos, cfg)
    return out, (q, k, v, seg, pos, out, lse)


def _ring_bwd(cfg: RingConfig, res, do):
    q, k, v, seg, pos, out, lse = res
    B, T, H, D = q.shape
    K = k.shape[2]
    b = cfg.block
    scale = 1.0 / math.sqrt(D)
    qp, kv, sp_q, sp_k = _prepare(q, k, v, seg, pos, cfg)
    qb = _q_blocks(qp, K, b) * scale
    Tp = qp.shape[1]
    dob = _q_blocks(_pad_t(do, Tp, 0), K, b)  # fill rows get a zero cotangent
    delta = (dob * _q_blocks(_pad_t(out, Tp, 0), K, b)).sum(-1)  # rowsum(dO * O)
    sq, pq = _blocks_tokens(sp_q[..., 0], b), _blocks_tokens(sp_q[..., 1], b)

    def step(active, local, ride, dkv, dq):
        kb_all, vb_all, sk, pk = _key_blocks(*ride, b)
        kinds = _round_kinds(sq, pq, sk, pk, active, local)
        dq, dkv = _bwd_pair(qb, sq, pq, dob, lse, delta, kb_all, vb_all, sk, pk, kinds, dq, dkv)
        return dkv, dq

    dkv = _full(qb, (Tp // b, B, 2 * K, b, D))
    dkv, dq = _ring_loop(cfg, step, (kv, sp_k), dkv, _full(qb, qb.shape))  # dkv is home
    dq = (_from_q_blocks(dq, T) * scale).astype(q.dtype)
    dkv = _from_kv_blocks(dkv, T)
    dk, dv = dkv[:, :, :K].astype(k.dtype), dkv[:, :, K:].astype(v.dtype)
    return dq, dk, dv, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- public


def _check(q, k, v, seg, pos, axis_name, groups, block) -> RingConfig:
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype: {q.dtype=} {k.dtype=} {v.dtype=}")
    B, T, _, _, _ = check_qkv(q, k, v, None)
    for name, x in (("seg_BxT", seg), ("pos_BxT", pos)):
        if tuple(x.shape) != (B, T):
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be (B, T)={(B, T)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype=}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive int")
    groups = check_groups(groups, _axis_size(axis_name))
    return RingConfig(axis_name=axis_name, groups=groups, block=min(block, T))


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
) -> jax.Array:
    """Causal document attention over ring groups; call inside shard_map over `axis_name`.

    q [B,T,H,D], k/v [B,T,K,D] (this device's T tokens, any order; H % K == 0, query head h
    reads kv head h // (H//K)), seg/pos [B,T] int segment ids (0 = padding, real ids > 0 and
    unique per document within a group) and positions. `groups` = ((start, degree), ...)
    tiles the axis. Returns [B,T,H,D] in q's dtype; differentiable (ring backward).
    Padding outputs are finite but arbitrary (they attend only part of the padding).
    Note (JAX semantics, not this function): under shard_map(check_vma=False), jax.grad taken
    inside the body of a psum'd loss comes out N times too large (psum transposes to psum);
    differentiate outside the shard_map, or keep check_vma=True.
    """
    cfg = _check(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, seg_BxT, pos_BxT, axis_name, groups, block)
    seg = seg_BxT.astype(jnp.int32)
    pos = pos_BxT.astype(jnp.int32)
    return _ring(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, seg, pos, cfg)


def ring_block_counts(seg_BxT, pos_BxT, *, axis_name: str, groups, block: int = 256) -> jax.Array:
    """int32 scalar: (query block, key block) pairs this device computes in the forward,
    summed over all rounds (the backward visits the same pairs). Call inside shard_map."""
    B, T = seg_BxT.shape
    cfg = RingConfig(axis_name, check_groups(groups, _axis_size(axis_name)), min(block, T))
    b = cfg.block
    Tp = -(-T // b) * b
    sp = jnp.stack([seg_BxT.astype(jnp.int32), pos_BxT.astype(jnp.int32)], axis=-1)
    sp_q, sp_k = _pad_t(sp, Tp, _Q_FILL), _pad_t(sp, Tp, _K_FILL)
    sq, pq = _blocks_tokens(sp_q[..., 0], b), _blocks_tokens(sp_q[..., 1], b)

    def step(active, local, sp_k, _, count):
        sk, pk = _blocks_tokens(sp_k[..., 0], b), _blocks_tokens(sp_k[..., 1], b)
        kinds = _round_kinds(sq, pq, sk, pk, active, local)
        return None, count + (kinds != SKIP).sum(dtype=jnp.int32)

    return _ring_loop(cfg, step, sp_k, None, lax.full_like(sq, 0, jnp.int32, ()))[1]
