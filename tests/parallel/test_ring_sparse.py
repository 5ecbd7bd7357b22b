"""Routed block-sparse ring attention on 8 simulated CPU devices vs single-device sparse_attend.

Each batch row holds, per ring group, a few documents (one spanning many blocks, a 1-token
one, others random) with their own budgets, laid out as the executor does: every document
padded to whole blocks, the group's stream padded to 2·d·c tokens and cut zigzag (rank r
holds chunks r and 2d−1−r). The reference row puts the same documents, block-aligned, one
after another; the ring's outputs and dq/dk/dv are mapped back to it by token. Padding tokens
carry random values on both sides (they must not leak); segment ids are unique per row, and
the same ids recur in other rows (rows must not mix). The problems and the reference are
in ring_sparse_problems.py (shared with test_ring_sparse_pallas.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxsb.parallel.ring_sparse import ring_sparse_attention, ring_sparse_iterations
from jaxsb.models.router import route
from ring_sparse_problems import (ALL, B, BS, D, H, K, N, SPEC, T, ring_groups, ring_problem,
                                  ring_reference, ring_values)
from tolerances import tol

from jax import shard_map


def _mesh():
    return Mesh(np.array(jax.devices()[:N]), ("d",))


@functools.partial(jax.jit, static_argnames=("groups", "grads", "check_vma", "floor"))
def _run_ring(q, k, v, seg, pos, bud, ct, groups, grads=True, check_vma=False, floor=None):
    def body(q, k, v, seg, pos, bud, ct):
        out, stats = ring_sparse_attention(q, k, v, seg, pos, bud, axis_name="d", groups=groups, block_size=BS,
                                           floor=floor)
        loss = jnp.sum(out.astype(jnp.float32) * ct)
        return loss[None], (out, {k: v[None] for k, v in stats.items()}, jnp.sum(seg > 0)[None])

    f = shard_map(body, mesh=_mesh(), in_specs=(SPEC,) * 7,
                  out_specs=(P("d"), (SPEC, P("d"), P("d"))), check_vma=check_vma)

    def loss_fn(q, k, v):
        loss, aux = f(q, k, v, seg, pos, bud, ct)
        return loss.sum(), aux

    if not grads:
        return loss_fn(q, k, v)[1], None
    (_, aux), g = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return aux, g


_route = jax.jit(functools.partial(route, block_size=BS), static_argnames=("floor",))


def _token_weighted_stats(qr, kr, seg, bud, floor=None):
    """The reference's mean selected blocks and coverage, weighted by real tokens per block;
    with the floor, also its token-weighted final budgets and overridden share."""
    _, counts, coverage = _route(qr, kr, jnp.asarray(seg), jnp.asarray(bud), floor=floor)
    w = (seg > 0).reshape(B, -1, BS).sum(-1)  # [B, nq]
    blocks = (np.asarray(counts) * w[:, None]).sum() / (K * w.sum())
    cov = (np.asarray(coverage.per_kv_head) * w.sum(-1)[:, None]).sum() / (K * w.sum())
    if floor is None:
        return blocks, cov, None
    f = coverage.floor
    real = w > 0
    return blocks, cov, ((np.asarray(f.final) * w).sum() / w.sum(), (np.asarray(f.overridden) * w).sum() / w.sum(),
                         max(0.0, np.asarray(f.drop)[real].max()), min(1.0, np.asarray(f.coverage)[real].min()))


def _compare(degrees, seed, budget_choices, dtype=jnp.float32, grads=True, dense=False,
             tied_keys=False, check_vma=False, floor=None):
    groups = ring_groups(degrees)
    ring, ref, _ = ring_problem(degrees, seed, budget_choices)
    (qr, kr, vr, ctr), (q, k, v, ct) = ring_values(ring, ref, seed, dtype, tied_keys)
    (out, stats, ntok), ring_grads = _run_ring(
        q, k, v, *(jnp.asarray(ring[f]) for f in ("seg", "pos", "bud")), ct, groups=groups, grads=grads,
        check_vma=check_vma, floor=floor)
    blocks, cov = stats["sparse_blocks"], stats["sparse_coverage"]
    assert out.dtype == dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()  # padding rows too
    real = ring["ref"] >= 0
    bidx = np.nonzero(real)[0]
    ridx = ring["ref"][real]
    assert len(set(zip(bidx, ridx))) == (ref["seg"] > 0).sum()  # every real token once

    refs = [ring_reference(qr, kr, vr, jnp.asarray(ref["seg"]), jnp.asarray(ref["bud"]), ctr, floor=floor)]
    if dense:
        refs.append(ring_reference(qr, kr, vr, jnp.asarray(ref["seg"]), jnp.asarray(ref["bud"]), ctr, dense=True))
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
    ref_blocks, ref_cov, ref_floor = _token_weighted_stats(qr, kr, ref["seg"], ref["bud"], floor)
    weighted = lambda x: (np.asarray(x) * ntok).sum() / ntok.sum()  # noqa: E731
    np.testing.assert_allclose(weighted(blocks), ref_blocks, rtol=1e-6)
    np.testing.assert_allclose(weighted(cov), ref_cov, **tol("router_coverage", "float32"))
    if floor is not None:
        np.testing.assert_allclose(weighted(stats["floor_final"]), ref_floor[0], rtol=1e-6)
        np.testing.assert_allclose(weighted(stats["floor_overridden"]), ref_floor[1], rtol=1e-6)
        # the worst document over every device == over the reference rows
        np.testing.assert_allclose(np.max(stats["floor_drop_max"]), ref_floor[2], **tol("router_coverage", "float32"))
        np.testing.assert_allclose(np.min(stats["floor_coverage_min"]), ref_floor[3], **tol("router_coverage", "float32"))
        return np.asarray(blocks), ref_floor
    return np.asarray(blocks)


@pytest.mark.parametrize("degrees", [(8,), (4, 2, 1, 1), (2, 2, 2, 2)])
def test_mixed_budgets_f32(degrees):
    """Budgets per document from 1 (diagonal only) to all blocks; outputs, grads, stats."""
    _compare(degrees, seed=sum(degrees) + len(degrees), budget_choices=[1, 2, 3, ALL])


@pytest.mark.parametrize("degrees", [(8,), (4, 2, 1, 1)])
def test_runtime_floor_equals_the_single_row_floor(degrees):
    """Planned budgets below the base: the floor raises some documents (their curves averaged
    over every rank of the ring) exactly as route() does on the same documents in one row."""
    _, (final, overridden, drop_max, coverage_min) = _compare(degrees, seed=11 + len(degrees), budget_choices=[1, 2],
                                                              floor=(4, 0.05))
    assert 0 < overridden < 1, "the case must exercise the floor on some documents and not others"
    assert 0 <= drop_max <= 0.05 + 1e-6 and 0 < coverage_min < 1  # the floor's bound p, measured


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
    groups = ring_groups(degrees)
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
    ring, ref, block_maps = ring_problem(degrees, 11, budgets)
    (qr, kr, _, _), (q, k, _, _) = ring_values(ring, ref, 11, jnp.float32)
    got = _iterations(degrees, ring, q, k)  # [N, max_degree]
    if budgets == [1]:
        np.testing.assert_array_equal(got, np.tile([1, 0, 0, 0], (N, 1)))
        return
    idx, counts, _ = _route(qr, kr, jnp.asarray(ref["seg"]), jnp.asarray(ref["bud"]))
    idx, counts = np.asarray(idx), np.asarray(counts)
    cb = T // (2 * BS)
    want = np.zeros((N, 4), np.int64)
    for gi, (s, d) in enumerate(ring_groups(degrees)):
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
