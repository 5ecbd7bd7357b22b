"""Routed block-sparse ring problems shared by tests/parallel/test_ring_sparse.py (the XLA ring) and
tests/kernels/test_ring_sparse_pallas.py (the ring on the Pallas chunk kernels).

Each batch row holds, per ring group, a few documents (one spanning many blocks, a 1-token
one, others random) with their own budgets, laid out as the executor does: every document
padded to whole blocks, the group's stream padded to 2·d·c tokens and cut zigzag (rank r
holds chunks r and 2d−1−r). The reference row puts the same documents, block-aligned, one
after another (`ring_problem`); `ring_values` draws q, k, v and a cotangent for both layouts,
`ring_reference` is the single-device answer (sparse_attend, or dense attention).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxsb.models.attention import sparse_attend
from kernels_pallas import attention_reference

N, BS, T = 8, 4, 24  # devices, block size, tokens per device (2 chunks of 3 blocks)
H, K, D, B = 4, 2, 8, 2  # GQA ratio 2
SPEC = P(None, "d")
ALL = 10**6  # a budget larger than any document


def ring_groups(degrees):
    starts = np.cumsum((0,) + tuple(degrees))[:-1]
    return tuple((int(s), int(d)) for s, d in zip(starts, degrees))


def doc_blocks(n):
    return -(-n // BS)


def group_docs(cap_blocks, rng):
    """Document lengths filling at most cap_blocks blocks: one long (over half the stream),
    one of 1 token, then random ones; in random order."""
    docs = [(cap_blocks // 2) * BS + 1, 1]
    while True:
        n = int(rng.integers(2, 3 * BS + 1))
        if sum(map(doc_blocks, docs)) + doc_blocks(n) > cap_blocks - 1:
            break
        docs.append(n)
    assert sum(map(doc_blocks, docs)) <= cap_blocks
    return [docs[i] for i in rng.permutation(len(docs))]


def ring_problem(degrees, seed, budget_choices):
    """Ring layout fields [B, N*T] (`ref`: the token's index in the reference row, -1 for
    padding) and the reference rows [B, R]; plus, per row and group, the stream block -> the
    reference block (-1 padding). Reference rows end with padding up to N*T tokens."""
    rng = np.random.default_rng(seed)
    ring = {f: np.zeros((B, N * T), np.int32) for f in ("seg", "pos", "bud")}
    ring["ref"] = np.full((B, N * T), -1, np.int64)
    rows, block_maps = [], []
    for b in range(B):
        seg, pos, bud = [], [], []
        maps = []
        for s, d in ring_groups(degrees):
            stream = {f: np.zeros(d * T, np.int64) for f in ("seg", "pos", "bud")}
            stream["ref"] = np.full(d * T, -1, np.int64)
            bmap = np.full(d * T // BS, -1, np.int64)
            at = 0
            for n in group_docs(d * T // BS, rng):
                doc_id = len(set(seg) - {0}) + 1
                budget = int(rng.choice(budget_choices))
                r0 = len(seg)
                stream["seg"][at:at + n] = doc_id
                stream["pos"][at:at + n] = np.arange(n)
                stream["bud"][at:at + n] = budget
                stream["ref"][at:at + n] = r0 + np.arange(n)
                bmap[at // BS:at // BS + doc_blocks(n)] = r0 // BS + np.arange(doc_blocks(n))
                padded = doc_blocks(n) * BS
                seg += [doc_id] * n + [0] * (padded - n)
                pos += list(range(n)) + [0] * (padded - n)
                bud += [budget] * n + [0] * (padded - n)
                at += padded
            maps.append(bmap)
            c = T // 2
            for r in range(d):
                chunks = np.r_[r * c:(r + 1) * c, (2 * d - 1 - r) * c:(2 * d - r) * c]
                for f in ring:
                    ring[f][b, (s + r) * T:(s + r + 1) * T] = stream[f][chunks]
        rows.append((seg, pos, bud))
        block_maps.append(maps)
    R = N * T  # one shape for every problem: the reference programs compile once
    assert max(len(r[0]) for r in rows) <= R
    ref = {f: np.zeros((B, R), np.int32) for f in ("seg", "pos", "bud")}
    for b, row in enumerate(rows):
        for f, x in zip(("seg", "pos", "bud"), row):
            ref[f][b, :len(x)] = x
    return ring, ref, block_maps


def ring_values(ring, ref, seed, dtype, tied_keys=False):
    """Reference q, k, v and cotangent [B, R, ...]; the ring's copies by token, random values
    (and zero cotangents) at ring padding. tied_keys: one key per (document, kv head), so all
    its full blocks score the same and ties decide the selection."""
    rng = np.random.default_rng(seed + 100)
    R = ref["seg"].shape[1]
    real = ring["ref"] >= 0
    idx = np.where(real, ring["ref"], 0)
    out = []
    for i, n in enumerate((H, K, K, H)):
        x_ref = rng.normal(size=(B, R, n, D)).astype(np.float32)
        if tied_keys and i == 1:
            x_ref = np.take_along_axis(rng.normal(size=(B, R, n, D)).astype(np.float32),
                                       ref["seg"][:, :, None, None], axis=1)
        x_ring = rng.normal(size=(B, N * T, n, D)).astype(np.float32)
        x_ring[real] = np.take_along_axis(x_ref, idx[:, :, None, None], axis=1)[real]
        out.append((x_ref, x_ring))
    (qr, q), (kr, k), (vr, v), (ctr, ct) = out
    ctr *= (ref["seg"] > 0)[:, :, None, None]
    ct *= real[:, :, None, None]
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(qr), cast(kr), cast(vr), jnp.asarray(ctr)), (cast(q), cast(k), cast(v), jnp.asarray(ct))


@functools.partial(jax.jit, static_argnames=("dense", "floor"))
def ring_reference(q, k, v, seg, bud, ct, dense=False, floor=None):
    if dense:
        attend = lambda q, k, v: attention_reference(q, k, v, seg)  # noqa: E731
    else:
        attend = lambda q, k, v: sparse_attend(q, k, v, seg, bud, block_size=BS, floor=floor)[0]  # noqa: E731
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(ct.astype(out.dtype))
