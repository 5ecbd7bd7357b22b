"""Routed block-sparse ring attention on 8 simulated CPU devices vs single-device sparse_attend.

Each batch row holds, per ring group, a few documents (one spanning many blocks, a 1-token
one, others random) with their own budgets, laid out as the executor does: every document
padded to whole blocks, the group's stream padded to 2·d·c tokens and cut zigzag (rank r
holds chunks r and 2d−1−r). The reference row puts the same documents, block-aligned, one
after another; the ring's outputs and dq/dk/dv are mapped back to it by token. Padding tokens
carry random values on both sides (they must not leak); segment ids are unique per row, and
the same ids recur in other rows (rows must not mix).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxsb.models.attention import sparse_attend
from jaxsb.parallel.ring_sparse import ring_sparse_attention, ring_sparse_iterations
from jaxsb.router import route
from kernels_pallas.flash_attention.reference import attention_reference
from tolerances import tol

try:
    from jax import shard_map
except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map

N, BS, T = 8, 4, 24  # devices, block size, tokens per device (2 chunks of 3 blocks)
H, K, D, B = 4, 2, 8, 2  # GQA ratio 2
SPEC = P(None, "d")
ALL = 10**6  # a budget larger than any document


def _mesh():
    return Mesh(np.array(jax.devices()[:N]), ("d",))


def _groups(degrees):
    starts = np.cumsum((0,) + tuple(degrees))[:-1]
    return tuple((int(s), int(d)) for s, d in zip(starts, degrees))


def _blocks(n):
    return -(-n // BS)


def _group_docs(cap_blocks, rng):
    """Document lengths filling at most cap_blocks blocks: one long (over half the stream),
    one of 1 token, then random ones; in random order."""
    docs = [(cap_blocks // 2) * BS + 1, 1]
    while True:
        n = int(rng.integers(2, 3 * BS + 1))
        if sum(map(_blocks, docs)) + _blocks(n) > cap_blocks - 1:
            break
        docs.append(n)
    assert sum(map(_blocks, docs)) <= cap_blocks
    return [docs[i] for i in rng.permutation(len(docs))]


def _problem(degrees, seed, budget_choices):
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
        for s, d in _groups(degrees):
            stream = {f: np.zeros(d * T, np.int64) for f in ("seg", "pos", "bud")}
            stream["ref"] = np.full(d * T, -1, np.int64)
            bmap = np.full(d * T // BS, -1, np.int64)
            at = 0
            for n in _group_docs(d * T // BS, rng):
                doc_id = len(set(seg) - {0}) + 1
                budget = int(rng.choice(budget_choices))
                r0 = len(seg)
                stream["seg"][at:at + n] = doc_id
                stream["pos"][at:at + n] = np.arange(n)
                stream["bud"][at:at + n] = budget
                stream["ref"][at:at + n] = r0 + np.arange(n)
                bmap[at // BS:at // BS + _blocks(n)] = r0 // BS + np.arange(_blocks(n))
                padded = _blocks(n) * BS
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


def _values(ring, ref, seed, dtype, tied_keys=False):
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


@functools.partial(jax.jit, static_argnames=("groups", "grads", "check_vma"))
def _run_ring(q, k, v, seg, pos, bud, ct, groups, grads=True, check_vma=False):
    def body(q, k, v, seg, pos, bud, ct):
        out, blocks, cov = ring_sparse_attention(q, k, v, seg, pos, bud, axis_name="d",
                                                 groups=groups, block_size=BS)
        loss = jnp.sum(out.astype(jnp.float32) * ct)
        return loss[None], (out, blocks[None], cov[None], jnp.sum(seg > 0)[None])

    f = shard_map(body, mesh=_mesh(), in_specs=(SPEC,) * 7,
                  out_specs=(P("d"), (SPEC, P("d"), P("d"), P("d"))), check_vma=check_vma)

    def loss_fn(q, k, v):
        loss, aux = f(q, k, v, seg, pos, bud, ct)
        return loss.sum(), aux

    if not grads:
        return loss_fn(q, k, v)[1], None
    (_, aux), g = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return aux, g


@functools.partial(jax.jit, static_argnames=("dense",))
def _reference(q, k, v, seg, bud, ct, dense=False):
    if dense:
        attend = lambda q, k, v: attention_reference(q, k, v, seg)  # noqa: E731
    else:
        attend = lambda q, k, v: sparse_attend(q, k, v, seg, bud, block_size=BS)[0]  # noqa: E731
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(ct.astype(out.dtype))


_route = jax.jit(functools.partial(route, block_size=BS))


def _token_weighted_stats(qr, kr, seg, bud):
    """The reference's mean selected blocks and coverage, weighted by real tokens per block."""
    _, counts, coverage = _route(qr, kr, jnp.asarray(seg), jnp.asarray(bud))
    w = (seg > 0).reshape(B, -1, BS).sum(-1)  # [B, nq]
    blocks = (np.asarray(counts) * w[:, None]).sum() / (K * w.sum())
    cov = (np.asarray(coverage.per_kv_head) * w.sum(-1)[:, None]).sum() / (K * w.sum())
    return blocks, cov


def _compare(degrees, seed, budget_choices, dtype=jnp.float32, grads=True, dense=False,
             tied_keys=False, check_vma=False):
    groups = _groups(degrees)
    ring, ref, _ = _problem(degrees, seed, budget_choices)
    (qr, kr, vr, ctr), (q, k, v, ct) = _values(ring, ref, seed, dtype, tied_keys)
    (out, blocks, cov, ntok), ring_grads = _run_ring(
        q, k, v, *(jnp.asarray(ring[f]) for f in ("seg", "pos", "bud")), ct, groups=groups, grads=grads,
        check_vma=check_vma)
    assert out.dtype == dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()  # padding rows too
    real = ring["ref"] >= 0
    bidx = np.nonzero(real)[0]
    ridx = ring["ref"][real]
    assert len(set(zip(bidx, ridx))) == (ref["seg"] > 0).sum()  # every real token once

    refs = [_reference(qr, kr, vr, jnp.asarray(ref["seg"]), jnp.asarray(ref["bud"]), ctr)]
    if dense:
        refs.append(_reference(qr, kr, vr, jnp.asarray(ref["seg"]), jnp.asarray(ref["bud"]), ctr, dense=True))
    for ref_out, ref_grads in refs:
        np.testing.assert_allclose(np.asarray(out, np.float32)[real],
                                   np.asarray(ref_out, np.float32)[bidx, ridx],
                                   **tol("attention_out", dtype))
        if grads:
            for name, g, r in zip("qkv", ring_grads, ref_grads):
                g = np.asarray(g, np.float32)
                np.testing.assert_allclose(g[real], np.asarray(r, np.float32)[bidx, ridx],
                                           **tol("attention_grad", dtype), err_msg=f"d{name}")
                assert not g[~real].any(), f"d{name} nonzero at padding"

    # statistics: token-weighted over devices == token-weighted over the reference rows
    ntok = np.asarray(ntok, np.float64)
    ref_blocks, ref_cov = _token_weighted_stats(qr, kr, ref["seg"], ref["bud"])
    np.testing.assert_allclose((np.asarray(blocks) * ntok).sum() / ntok.sum(), ref_blocks, rtol=1e-6)
    np.testing.assert_allclose((np.asarray(cov) * ntok).sum() / ntok.sum(), ref_cov,
                               **tol("router_coverage", "float32"))
    return np.asarray(blocks)


@pytest.mark.parametrize("degrees", [(8,), (4, 2, 1, 1), (2, 2, 2, 2)])
def test_mixed_budgets_f32(degrees):
    """Budgets per document from 1 (diagonal only) to all blocks; outputs, grads, stats."""
    _compare(degrees, seed=sum(degrees) + len(degrees), budget_choices=[1, 2, 3, ALL])


def test_ties_go_to_the_lower_stream_block():
    """Keys constant per document: every full block of a document scores the same, so the
    selection is diagonal + the earliest blocks in stream order, which zigzag scatters over
    the ring (a local or per-device order would pick others and change the outputs)."""
    _compare((8,), seed=5, budget_choices=[2, 3], tied_keys=True)


def test_all_blocks_equals_dense():
    """Every budget covers the whole document: sparse ring == dense attention (and sparse_attend)."""
    _compare((4, 2, 1, 1), seed=7, budget_choices=[ALL], dense=True)


def test_forward_bf16():
    """bf16 inputs (float32 inside); also traced with check_vma=True (the executor uses False)."""
    _compare((2, 2, 2, 2), seed=3, budget_choices=[1, 2, ALL], dtype=jnp.bfloat16, grads=False,
             check_vma=True)


def _iterations(degrees, ring, q, k):
    groups = _groups(degrees)
    f = shard_map(lambda q, k, s, b: ring_sparse_iterations(
        q, k, s, b, axis_name="d", groups=groups, block_size=BS)[None],
        mesh=_mesh(), in_specs=(SPEC,) * 4, out_specs=P("d"), check_vma=False)
    return np.asarray(jax.jit(f)(q, k, jnp.asarray(ring["seg"]), jnp.asarray(ring["bud"])))


@pytest.mark.parametrize("budgets", [[1], [2, 3]])
def test_work_follows_selection(budgets):
    """Loop iterations per (device, round) == the most blocks any query block of the device
    selected from the shard visiting in that round, computed from the reference routing; with
    budget 1 every device runs exactly one iteration, in round 0 (its diagonals)."""
    degrees = (4, 2, 1, 1)
    ring, ref, block_maps = _problem(degrees, 11, budgets)
    (qr, kr, _, _), (q, k, _, _) = _values(ring, ref, 11, jnp.float32)
    got = _iterations(degrees, ring, q, k)  # [N, max_degree]
    if budgets == [1]:
        np.testing.assert_array_equal(got, np.tile([1, 0, 0, 0], (N, 1)))
        return
    idx, counts, _ = _route(qr, kr, jnp.asarray(ref["seg"]), jnp.asarray(ref["bud"]))
    idx, counts = np.asarray(idx), np.asarray(counts)
    cb = T // (2 * BS)
    want = np.zeros((N, 4), np.int64)
    for gi, (s, d) in enumerate(_groups(degrees)):
        def owner(g):
            chunk = g // cb
            return chunk if chunk < d else 2 * d - 1 - chunk

        for r in range(d):
            stream_blocks = np.r_[r * cb:(r + 1) * cb, (2 * d - 1 - r) * cb:(2 * d - r) * cb]
            for b in range(B):
                to_stream = {rb: g for g, rb in enumerate(block_maps[b][gi]) if rb >= 0}
                for g in stream_blocks:
                    rb = block_maps[b][gi][g]
                    for kk in range(K):
                        sel = [g] if rb < 0 else [to_stream[j] for j in idx[b, kk, rb, :counts[b, kk, rb]]]
                        owners = np.bincount([owner(x) for x in sel], minlength=d)
                        for t in range(d):
                            want[s + r, t] = max(want[s + r, t], owners[(r - t) % d])
    np.testing.assert_array_equal(got, want)
    assert got[:, 1:].sum() > 0  # some blocks come from other devices


def test_rejects_unaligned_chunks():
    x = jnp.zeros((1, 8 * 12, H, D))
    kv = jnp.zeros((1, 8 * 12, K, D))
    ids = jnp.ones((1, 8 * 12), jnp.int32)
    f = shard_map(lambda q, k, s: ring_sparse_attention(q, k, k, s, s, s, axis_name="d", groups=((0, 8),),
                                                        block_size=BS)[0],
                  mesh=_mesh(), in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False)
    with pytest.raises(ValueError, match="T=12 must be a multiple of 2\\*block_size=8"):
        jax.eval_shape(f, x, kv, ids)
