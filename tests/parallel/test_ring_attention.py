"""Ring attention on 8 simulated CPU devices vs the dense oracle, per group.

Each group's token stream (packed documents, then padding) is laid out zigzag over its ranks,
ring_attention runs under shard_map, and the outputs and dq/dk/dv (jax.grad of a psum'd loss
computed inside the shard_map body) are un-permuted and compared with
`attention_reference` run per group on the stream in its natural order. Segment ids repeat
across groups (every group numbers its documents from 1), so a kv shard leaking into another
group would change the result.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax import shard_map

from jaxsb.parallel.ring import FULL, PARTIAL, SKIP, block_kinds, ring_attention, ring_block_counts
from jaxsb.parallel.ring_loop import check_groups
from jaxsb.plan.layout import zigzag_layout
from kernels_pallas.flash_attention.reference import attention_reference
from attention_inputs import packed_stream
from tolerances import tol

N = 8
T_LOCAL = 64  # tokens per device
SPEC = P(None, "d")


def _mesh():
    return Mesh(np.array(jax.devices()[:N]), ("d",))


def _groups(degrees):
    starts = np.cumsum((0,) + tuple(degrees))[:-1]
    return tuple((int(s), int(d)) for s, d in zip(starts, degrees))


def _stream(length, rng, row):
    """seg, pos [length] of one group row: documents (a 1-token one; on row 0 one spanning
    over half the stream) then at least 3 padding tokens."""
    room = length - 3
    docs = [1, length // 2 + 3] if row == 0 else [1]
    while sum(docs) < room:
        docs.append(int(rng.integers(2, max(3, length // 3))))
    docs[-1] -= sum(docs) - room
    docs = [n for n in docs if n > 0]
    docs = [docs[i] for i in rng.permutation(len(docs))]
    return packed_stream(length, docs)


def _problem(degrees, B, seed, shuffle=False):
    """Global stream seg/pos [B, N*T] (group g owns [s*T, (s+d)*T)) and the zigzag
    permutation: the sharded array is stream[:, perm]. shuffle: tokens also in random order
    within each device (ring_attention must mask by (seg, pos) only)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, N * T_LOCAL), np.int32)
    pos = np.zeros((B, N * T_LOCAL), np.int32)
    perm = []
    for s, d in _groups(degrees):
        lo, n = s * T_LOCAL, d * T_LOCAL
        for b in range(B):
            seg[b, lo : lo + n], pos[b, lo : lo + n] = _stream(n, rng, b)
        zig = zigzag_layout(n, d)
        assert zig.shape == (d, T_LOCAL) and zig.max() < n
        if shuffle:
            zig = np.stack([rng.permutation(row) for row in zig])
        perm.append(lo + zig.reshape(-1))
    return seg, pos, np.concatenate(perm)


def _run_ring(q, k, v, seg, pos, ct, groups, block, grads, check_vma=True):
    """(out, (dq, dk, dv) or None) in the sharded layout; one jitted program.

    grads="outside": jax.grad of the shard_map whose body returns the psum'd loss;
    grads="inside": jax.grad taken inside the body (needs check_vma=True: without it the
    transpose of psum is a psum and every gradient comes out N times too large)."""

    def body(q, k, v, seg, pos, ct):
        def loss_fn(q, k, v):
            out = ring_attention(q, k, v, seg, pos, axis_name="d", groups=groups, block=block)
            return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * ct), "d"), out

        if grads == "inside":
            return jax.grad(loss_fn, argnums=(0, 1, 2), has_aux=True)(q, k, v)[::-1]
        return loss_fn(q, k, v)

    if grads == "inside":
        assert check_vma
        f = shard_map(body, mesh=_mesh(), in_specs=(SPEC,) * 6, out_specs=(SPEC, (SPEC,) * 3))
        return jax.jit(f)(q, k, v, seg, pos, ct)
    f = shard_map(body, mesh=_mesh(), in_specs=(SPEC,) * 6, out_specs=(P(), SPEC),
                  check_vma=check_vma)
    if not grads:
        return jax.jit(f)(q, k, v, seg, pos, ct)[1], None

    @jax.jit
    def run(q, k, v):
        (_, out), grads = jax.value_and_grad(
            lambda q, k, v: f(q, k, v, seg, pos, ct), argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    return run(q, k, v)


@functools.partial(jax.jit, static_argnums=5)
def _reference(q, k, v, seg, ct, groups):
    """Oracle per group on the natural stream: out and (dq, dk, dv), concatenated."""

    def attend(q, k, v):
        outs = []
        for s, d in groups:
            sl = slice(s * T_LOCAL, (s + d) * T_LOCAL)
            outs.append(attention_reference(q[:, sl], k[:, sl], v[:, sl], seg[:, sl]))
        return jnp.concatenate(outs, axis=1)

    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(ct.astype(out.dtype))


def _compare(degrees, heads, kv_heads, dtype, block, grads, B=2, D=8, check_vma=True, seed=0,
             shuffle=False):
    groups = _groups(degrees)
    seg, pos, perm = _problem(degrees, B, seed, shuffle)
    inv = np.argsort(perm)
    rng = np.random.default_rng(seed + 1)
    q, k, v = (rng.normal(size=(B, N * T_LOCAL, n, D)).astype(np.float32)
               for n in (heads, kv_heads, kv_heads))
    ct = rng.normal(size=q.shape).astype(np.float32) * (seg > 0)[:, :, None, None]
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))

    out, ring_grads = _run_ring(q[:, perm], k[:, perm], v[:, perm], jnp.asarray(seg[:, perm]),
                                jnp.asarray(pos[:, perm]), jnp.asarray(ct[:, perm]), groups,
                                block, grads, check_vma)
    assert out.dtype == dtype
    ref_out, ref_grads = _reference(q, k, v, jnp.asarray(seg), jnp.asarray(ct), groups)
    ref_out = np.asarray(ref_out, np.float32)

    out = np.asarray(out, np.float32)[:, inv]
    assert np.isfinite(out).all()  # padding rows too
    real = seg > 0
    np.testing.assert_allclose(out[real], ref_out[real], **tol("attention_out", dtype))
    if grads:
        for name, g, r in zip("qkv", ring_grads, ref_grads):
            assert g.dtype == dtype
            np.testing.assert_allclose(np.asarray(g, np.float32)[:, inv], np.asarray(r, np.float32),
                                       **tol("attention_grad", dtype), err_msg=f"d{name}")


@pytest.mark.parametrize(
    "degrees, heads, kv_heads, block, variant",
    [
        ((8,), 4, 2, 16, {}),
        # block does not divide T (fill tokens); tokens shuffled within devices; no check_vma
        ((2, 2, 2, 2), 2, 2, 20, dict(shuffle=True, check_vma=False)),
        ((4, 2, 1, 1), 4, 2, 16, dict(grads="inside")),
        ((1,) * 8, 2, 2, 32, {}),
    ],
)
@pytest.mark.slow
def test_forward_and_grads_f32(degrees, heads, kv_heads, block, variant):
    variant = {"grads": "outside", **variant}
    _compare(degrees, heads, kv_heads, jnp.float32, block, **variant)


@pytest.mark.slow
def test_forward_bf16():
    _compare((4, 2, 1, 1), 4, 2, jnp.bfloat16, 16, grads=None, seed=5)


def test_block_kinds_against_brute_force():
    """On random blocks (ids 0..3, fill ids -1 / -2, random positions): SKIP only if no
    real (id > 0) entry is allowed, FULL only if every entry is; on the local shard every
    padding query keeps its diagonal block. Exact on the hand-made edge cases."""
    rng = np.random.default_rng(0)
    n, B, b = 6, 2, 4
    kinds_fn = jax.jit(block_kinds, static_argnums=4)
    for trial in range(20):
        local = trial % 4 < 2
        sq = rng.integers(-1 if trial % 2 else 0, 4, size=(n, B, b)).astype(np.int32)
        pq = rng.integers(0, 12, size=(n, B, b)).astype(np.int32)
        sk, pk = sq.copy(), pq.copy()
        if not local:
            sk, pk = rng.permutation(sk.reshape(-1)).reshape(sk.shape), rng.permutation(pk)
        sk[sk == -1] = -2
        kinds = np.asarray(kinds_fn(sq, pq, sk, pk, local))
        allowed = ((sq[:, None, :, :, None] == sk[None, :, :, None, :])
                   & (pk[None, :, :, None, :] <= pq[:, None, :, :, None]))  # [nq,nk,B,bq,bk]
        real = allowed & (sq > 0)[:, None, :, :, None]
        assert not real[kinds == SKIP].any()
        assert allowed[kinds == FULL].all()
        if local:
            has_pad = (sq == 0).any((1, 2))
            assert (np.diag(kinds)[has_pad] != SKIP).all()

    def kind(sq, pq, sk, pk, local=True):
        args = (jnp.asarray(x, jnp.int32)[None, None] for x in (sq, pq, sk, pk))
        return int(kinds_fn(*args, local)[0, 0])

    # one doc: the only allowed entry is the first key at the last query's position
    assert kind([1, 1], [4, 5], [1, 1], [5, 6]) == PARTIAL
    assert kind([1, 1], [4, 5], [1, 1], [6, 7]) == SKIP  # keys after queries
    assert kind([1, 1], [6, 7], [1, 1], [5, 6]) == FULL  # keys before queries
    assert kind([1, 2], [6, 0], [3, 3], [0, 1]) == SKIP  # disjoint ids
    # padding (id 0) only meets padding, and is kept out of the real ranges
    assert kind([0, 0], [0, 0], [0, 0], [0, 0]) == FULL
    assert kind([0, 0], [0, 0], [0, 0], [0, 0], local=False) == SKIP
    assert kind([1, 0], [3, 0], [0, 2], [0, 0]) == PARTIAL
    assert kind([1, 2], [3, 0], [0, 3], [0, 0]) == SKIP
    assert kind([1, -1], [3, 0], [-2, 1], [0, 1]) == PARTIAL  # fill ids match nothing
    assert kind([-1, -1], [0, 0], [-2, -2], [0, 0]) == SKIP


def _counts(seg, pos, groups, block):
    f = shard_map(
        lambda s, p: ring_block_counts(s, p, axis_name="d", groups=groups, block=block)[None],
        mesh=_mesh(), in_specs=(SPEC, SPEC), out_specs=P("d"))
    return np.asarray(jax.jit(f)(jnp.asarray(seg), jnp.asarray(pos)))


def test_zigzag_balances_block_work():
    """One 512-token document on one ring of 8, 16-token blocks (32 chunks of 2 blocks):
    zigzag gives every device exactly 66 block pairs, the causal total 32*33/2 = 528 split
    evenly (the skip test is exact here); a contiguous layout gives 10, 26, ..., 122."""
    n, block = N * T_LOCAL, 16
    seg = np.ones((1, n), np.int32)
    pos = np.arange(n, dtype=np.int32)[None]
    groups = ((0, N),)
    zig = zigzag_layout(n, N).reshape(-1)
    np.testing.assert_array_equal(_counts(seg[:, zig], pos[:, zig], groups, block), [66] * N)
    contiguous = _counts(seg, pos, groups, block)
    np.testing.assert_array_equal(contiguous, 16 * np.arange(N) + 10)
    # Half padding: rank r holds real chunk r (4r + 3 pairs) and a padding chunk, whose two
    # blocks only meet themselves (padding queries need some key, not all of them).
    seg[:, n // 2 :] = 0
    pos[:, n // 2 :] = 0
    counts = _counts(seg[:, zig], pos[:, zig], groups, block)
    np.testing.assert_array_equal(counts, 4 * np.arange(N) + 3 + 2)


def test_zigzag_layout():
    idx = zigzag_layout(10, 2)  # padded to 12, chunks of 3
    np.testing.assert_array_equal(idx, [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]])
    np.testing.assert_array_equal(np.sort(zigzag_layout(64, 4).reshape(-1)), np.arange(64))


def test_bad_groups():
    assert check_groups([[0, 2], [2, 6]], 8) == ((0, 2), (2, 6))
    for groups, match in [
        (((0, 4), (5, 3)), "must start at 4"),
        (((0, 4), (4, 0)), "degree >= 1"),
        (((0, 4), (4, 2)), "cover 6 devices but the axis has 8"),
        ((), "must not be empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_groups(groups, 8)
    x = jnp.zeros((1, N * 16, 2, 4))
    s = jnp.zeros((1, N * 16), jnp.int32)
    f = shard_map(functools.partial(ring_attention, axis_name="d", groups=((0, 4),), block=8),
                  mesh=_mesh(), in_specs=(SPEC,) * 5, out_specs=SPEC)
    with pytest.raises(ValueError, match="cover 4 devices but the axis has 8"):
        f(x, x[:, :, :1], x[:, :, :1], s, s)
