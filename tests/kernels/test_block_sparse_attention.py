"""Block-sparse attention (XLA version) vs the dense reference: outputs, gradients, masking.

Small shapes (T ~ 75, blocks of 8/16) so many blocks, padding, documents that straddle
blocks, one-token documents and partial last blocks are exercised quickly on CPU. Block lists
are random (a random subset of the causal blocks, valid ones first, garbage after the count)
or come from the router.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import tol
from attention_inputs import out_and_vjp as _out_and_vjp, random_blocks as _random_blocks, random_qkv as _inputs, segments as _segments

from jaxsb.models.router import route
from kernels_pallas import attention_reference, block_sparse_attention
from kernels_pallas.block_sparse_attention import block_sparse_attention_reference
from kernels_pallas.block_sparse_attention.reference import block_sparse_mask


def _assert_close(out, grads, out_ref, grads_ref, dtype):
    assert out.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(out_ref, np.float32), **tol("attention_out", dtype)
    )
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert g.dtype == dtype, name
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(g_ref, np.float32), err_msg=f"d{name}",
            **tol("attention_grad", dtype),
        )


T_MAIN = 75  # not a multiple of any block size below
# Row 0: a 50-token document over many blocks, a one-token document, then padding.
# Row 1: several short documents, one of length 1, no padding.
SEG_MAIN = [[50, 1, 20], [7, 1, 30, 12, 25]]

CASES = [
    # (name, H, K, block_size, budgets per row (None = every block), max_blocks)
    ("gqa1-bs8-diag-only", 4, 4, 8, [1, 1], 10),
    ("gqa2-bs8-mixed", 4, 2, 8, [3, 6], 6),
    ("gqa4-bs16-mixed", 4, 1, 16, [2, 4], 5),
    ("gqa2-bs16-all", 4, 2, 16, [5, 5], 5),
    ("gqa4-bs8-all", 8, 2, 8, [10, 10], 10),
]
PARAMS = [pytest.param(c, jnp.float32, id=f"{c[0]}-f32") for c in CASES] + [
    pytest.param(c, jnp.bfloat16, id=f"{c[0]}-bf16")
    for c in CASES if c[0] in ("gqa2-bs8-mixed", "gqa4-bs16-mixed")
]


@pytest.mark.parametrize("case, dtype", PARAMS)
@pytest.mark.slow
def test_xla_matches_reference(case, dtype):
    _, H, K, bs, budgets, M = case
    B, D = 2, 16
    nq = -(-T_MAIN // bs)
    q, k, v = _inputs(B, T_MAIN, H, K, D, dtype)
    seg = _segments(T_MAIN, SEG_MAIN)
    idx, counts = _random_blocks(B, K, nq, M, budgets, seed=2)

    def run(impl):
        return _out_and_vjp(
            lambda q, k, v: block_sparse_attention(q, k, v, idx, counts, seg, bs, impl), (q, k, v)
        )

    _assert_close(*run("xla"), *run("reference"), dtype)


@pytest.mark.parametrize("H, K", [(4, 4), (4, 2), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.slow
def test_all_blocks_equals_dense_causal_attention(H, K):
    """Every block selected (and a no-segment row): exactly dense causal document attention."""
    T, bs, B, D = T_MAIN, 16, 2, 16
    nq = -(-T // bs)
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=4)
    seg = _segments(T, SEG_MAIN)
    # reversed order and a few garbage slots after the count, to show order does not matter
    idx = jnp.broadcast_to(jnp.arange(nq + 2)[::-1] - 2, (B, K, nq, nq + 2)).astype(jnp.int32)
    idx = idx[..., ::-1][..., 2:]
    idx = jnp.concatenate([idx[..., ::-1], jnp.full((B, K, nq, 2), 99, jnp.int32)], -1)
    counts = jnp.full((B, K, nq), nq, jnp.int32)
    for s in (seg, None):
        sparse = lambda q, k, v, s=s: block_sparse_attention(q, k, v, idx, counts, s, bs, "xla")
        dense = lambda q, k, v, s=s: attention_reference(q, k, v, s, True)
        _assert_close(*_out_and_vjp(sparse, (q, k, v)), *_out_and_vjp(dense, (q, k, v)), jnp.float32)


@pytest.mark.slow
def test_router_selection_matches_reference_across_budgets():
    """End to end with the router's lists: budgets from the diagonal only to every block."""
    T, bs, B, H, K, D = T_MAIN, 8, 2, 4, 2, 16
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=5)
    seg = _segments(T, SEG_MAIN)
    # budgets and block lists are data, as in training: one program per implementation
    # serves every budget (closed over, each budget's lists would compile anew)
    lists = jax.jit(lambda budgets: route(q, k, seg, budgets, bs, max_blocks=6)[:2])
    run = {
        impl: jax.jit(lambda idx, counts, impl=impl: _out_and_vjp(
            lambda q, k, v: block_sparse_attention(q, k, v, idx, counts, seg, bs, impl), (q, k, v)
        ))
        for impl in ("xla", "reference")
    }
    for budgets in ([1, 1], [2, 5], [10, 10]):
        idx, counts = lists(jnp.asarray(budgets))
        _assert_close(*run["xla"](idx, counts), *run["reference"](idx, counts), jnp.float32)


@pytest.mark.slow
def test_invalid_slots_are_ignored_and_never_visited():
    """Entries past the count: changing them changes nothing (bit for bit), and the loop stops
    at max(counts): a NaN value block referenced only past every count never reaches the
    output (were those slots visited, 0 * NaN would poison every row)."""
    T, bs, B, H, K, D = 64, 8, 1, 4, 2, 8
    nq = T // bs
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=6)
    idx, counts = _random_blocks(B, K, nq, 8, [3], seed=7)
    f = jax.jit(lambda idx, counts, v: block_sparse_attention(q, k, v, idx, counts, None, bs))
    slot = jnp.arange(8)
    garbage = jnp.where(slot >= counts[..., None], 12345, idx)
    np.testing.assert_array_equal(f(idx, counts, v), f(garbage, counts, v))

    counts = jnp.full((B, K, nq), 2, jnp.int32)  # block 7 is valid only for query block 7
    idx = jnp.broadcast_to(jnp.array([7] * 8, jnp.int32), (B, K, nq, 8))
    idx = idx.at[..., 0].set(jnp.arange(nq)).at[..., 1].set(jnp.maximum(jnp.arange(nq) - 1, 0))
    idx = idx.at[:, :, 7, 1].set(6)
    v_nan = v.at[:, 56:].set(jnp.nan)
    out = np.asarray(f(idx, counts, v_nan))
    assert np.all(np.isfinite(out[:, :56])), "a slot past max(counts) was visited"


@pytest.mark.slow
def test_duplicates_count_once_and_empty_rows_are_zero():
    T, bs, B, H, K, D = 32, 8, 1, 2, 1, 8
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=8)
    nq = T // bs
    # query block n lists [n, n-1, n, n-1]: duplicates of valid entries
    base = jnp.stack([jnp.arange(nq), jnp.maximum(jnp.arange(nq) - 1, 0)] * 2, -1)
    idx = jnp.broadcast_to(base, (B, K, nq, 4)).astype(jnp.int32)
    counts = jnp.full((B, K, nq), 4, jnp.int32)
    once = jnp.broadcast_to(base[:, :2], (B, K, nq, 2)).astype(jnp.int32)
    attend = jax.jit(block_sparse_attention, static_argnums=(6, 7))  # one program per call, not op by op
    got = attend(q, k, v, idx, counts, None, bs, "xla")
    want = attend(q, k, v, once, jnp.full((B, K, nq), 2, jnp.int32), None, bs, "reference")
    np.testing.assert_allclose(got, want, **tol("attention_out", jnp.float32))
    # query block 2 lists only the future block 3: its rows see nothing and output zeros
    idx2 = once.at[:, :, 2, 0].set(3)
    c2 = jnp.full((B, K, nq), 2, jnp.int32).at[:, :, 2].set(1)
    for impl in ("xla", "reference"):
        out = np.asarray(attend(q, k, v, idx2, c2, None, bs, impl))
        np.testing.assert_array_equal(out[0, 16:24], 0.0)


@pytest.mark.slow
def test_no_information_crosses_documents_or_unselected_blocks():
    """Gradient of one document's outputs w.r.t. tokens of other documents / unselected blocks
    is exactly zero, even when the selection lists blocks of other documents."""
    T, bs, B, H, K, D = 48, 8, 1, 4, 2, 8
    nq = T // bs
    seg = _segments(T, [[12, 30, 3]])  # doc 2 spans blocks 1..5 (partly)
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=9)
    idx = jnp.broadcast_to(jnp.arange(nq)[::-1], (B, K, nq, nq)).astype(jnp.int32)
    counts = jnp.full((B, K, nq), nq, jnp.int32).at[:, :, 5].set(3)  # block 5 -> 5, 4, 3
    in_a = np.asarray(seg[0]) == 2
    w = jnp.asarray(np.random.default_rng(10).normal(size=(B, T, H, D)) * in_a[None, :, None, None], jnp.float32)
    loss = lambda q, k, v: (block_sparse_attention(q, k, v, idx, counts, seg, bs, "xla") * w).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, g in zip("qkv", grads):
        g = np.asarray(g)
        assert np.all(g[0, ~in_a] == 0.0), f"d{name} leaks outside document 2"
        assert np.any(g[0, in_a] != 0.0), f"d{name} is zero inside document 2"
    # keys of doc 2 in blocks 1, 2 are not selected by query block 5: no gradient from it
    w5 = w.at[:, :40].set(0.0)
    dk = jax.jit(jax.grad(lambda k: (block_sparse_attention(q, k, v, idx, counts, seg, bs) * w5).sum()))(k)
    dk = np.asarray(dk)
    assert np.all(dk[0, :24] == 0.0) and np.any(dk[0, 24:40] != 0.0)


@pytest.mark.slow
def test_reference_mask_is_a_real_oracle():
    """The reference mask vs an independent loop over tokens."""
    T, bs = 20, 4
    seg = _segments(T, [[9, 1, 7]])
    rng = np.random.default_rng(11)
    nq, M = 5, 3
    idx = rng.integers(-2, 8, size=(1, 1, nq, M)).astype(np.int32)
    counts = rng.integers(0, M + 1, size=(1, 1, nq)).astype(np.int32)
    mask = np.asarray(block_sparse_mask(jnp.asarray(idx), jnp.asarray(counts), seg, T, bs))
    s = np.asarray(seg[0])
    for i in range(T):
        chosen = {int(x) for x in idx[0, 0, i // bs, : counts[0, 0, i // bs]]}
        for j in range(T):
            want = (j // bs) in chosen and j <= i and s[i] == s[j]
            assert mask[0, 0, i, j] == want, (i, j)


@pytest.mark.slow
def test_jit_with_traced_counts_and_auto():
    """Counts are data: one compiled program serves every budget."""
    T, bs, B, H, K, D = 40, 8, 2, 4, 2, 8
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=12)
    seg = _segments(T, [[10, 30], [40]])
    f = jax.jit(lambda idx, c: block_sparse_attention(q, k, v, idx, c, seg, bs))
    for budgets in ([1, 5], [3, 2]):
        idx, counts = _random_blocks(B, K, 5, 5, budgets, seed=13)
        want = block_sparse_attention_reference(q, k, v, idx, counts, seg, bs)
        np.testing.assert_allclose(f(idx, counts), want, **tol("attention_out", jnp.float32))
    assert f._cache_size() == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"implementation": "triton"}, "implementation='triton'"),
        ({"block_size": 0}, "block_size=0"),
        ({"block_indices": np.zeros((2, 2, 3, 2), np.int32)}, "block_indices.shape=(2, 2, 3, 2)"),
        ({"block_counts": np.zeros((2, 2, 3), np.int32)}, "block_counts.shape=(2, 2, 3)"),
        ({"block_counts": np.zeros((2, 2, 2), np.float32)}, "block_counts must be integer"),
        ({"segment_ids": np.ones((2, 7), np.int32)}, "(2, 7)"),
        ({"k": np.zeros((2, 16, 3, 8), np.float32)}, "H=4 must be a multiple of kv heads K=3"),
    ],
)
def test_argument_errors(kwargs, message):
    args = {
        "q": np.zeros((2, 16, 4, 8), np.float32),
        "k": np.zeros((2, 16, 2, 8), np.float32),
        "v": np.zeros((2, 16, 2, 8), np.float32),
        "block_indices": np.zeros((2, 2, 2, 2), np.int32),
        "block_counts": np.ones((2, 2, 2), np.int32),
        "block_size": 8,
    }
    args.update(kwargs)
    if "k" in kwargs:
        args["v"] = args["k"]
    args = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in args.items()}
    with pytest.raises(ValueError) as info:
        block_sparse_attention(**args)
    assert message in str(info.value)


# ----------------------------------------------------------------------------- per-block work
# The XLA kernel sorts query blocks by their own count, runs groups of `group_size` of them
# for as many slot steps as the group's largest count, and skips the mask on steps where every
# pair is strictly below the diagonal inside one document (xla.Meta.full).


def _per_block_counts(B, K, nq, M, seed):
    """Lists as _random_blocks, but every query block its own count in [0, min(n + 1, M)]
    (0: the block sees nothing), so counts differ inside one row and one kv head."""
    idx, _ = _random_blocks(B, K, nq, M, [M] * B, seed=seed)
    rng = np.random.default_rng(seed + 100)
    cap = np.minimum(np.arange(nq) + 1, M)
    counts = rng.integers(0, cap + 1, size=(B, K, nq)).astype(np.int32)
    counts[..., -1] = cap[-1]  # the largest count sits last: sorting must move it
    return idx, jnp.asarray(counts)


@pytest.mark.parametrize("group_size", [1, 3, 4, 100], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.slow
def test_per_query_block_counts_match_reference(group_size, dtype):
    """Counts that differ per query block inside a row (zeros included), every grouping
    (1 = each block its own trip count; 3 does not divide nq = 10, so the last group holds
    filler blocks; 100 = one group, max-count steps for all): forward and dq/dk/dv."""
    from kernels_pallas.block_sparse_attention.xla import block_sparse_attention_xla

    T, bs, B, H, K, D, M = T_MAIN, 8, 2, 4, 2, 16, 6
    nq = -(-T // bs)
    q, k, v = _inputs(B, T, H, K, D, dtype, seed=20)
    seg = _segments(T, SEG_MAIN)
    idx, counts = _per_block_counts(B, K, nq, M, seed=21)
    assert len({int(c) for c in np.asarray(counts[0, 0])}) > 2
    got = _out_and_vjp(
        lambda q, k, v: block_sparse_attention_xla(q, k, v, idx, counts, seg, bs, group_size),
        (q, k, v),
    )
    want = _out_and_vjp(
        lambda q, k, v: block_sparse_attention(q, k, v, idx, counts, seg, bs, "reference"), (q, k, v)
    )
    _assert_close(*got, *want, dtype)


@pytest.mark.slow
def test_trip_counts_follow_each_query_blocks_count():
    """Groups of sorted blocks: a group's trip is its largest count, so a row whose counts are
    mostly small runs far fewer steps than max(counts) x blocks; the metadata is exact."""
    from kernels_pallas.block_sparse_attention import xla

    B, K, nq, M, bs = 1, 2, 12, 12, 8
    counts = np.ones((B, K, nq), np.int32)
    counts[0, 0, 11], counts[0, 1, 5] = 12, 6  # one long list per kv head
    idx = np.broadcast_to(np.arange(M)[::-1], (B, K, nq, M)).astype(np.int32)
    idx = np.where(np.arange(M) < counts[..., None], np.arange(nq)[:, None] - np.arange(M), idx)
    blocks = xla.make_sparse_blocks(B, nq * bs, 4, K, bs, gq=4)
    meta = xla._metadata(jnp.asarray(idx), jnp.asarray(counts), jnp.ones((B, nq * bs), jnp.int32),
                         blocks)
    assert np.asarray(meta.trip).tolist() == [12, 1, 1]  # not 3 x 12
    assert np.asarray(meta.perm)[0, 0, 0] == 11 and np.asarray(meta.perm)[0, 1, 0] == 5
    cnt = np.asarray(meta.cnt)
    assert np.all(np.diff(cnt, axis=-1) <= 0) and cnt[0, 0, 0] == 12 and cnt[0, 1, 0] == 6
    # lists come back clean: ascending valid blocks, then the filler nb
    lst = np.asarray(meta.lst)[0, 1, 0]
    assert lst.tolist() == [0, 1, 2, 3, 4, 5] + [nq] * 6


@pytest.mark.slow
def test_unmasked_steps_are_exact():
    """One document, lists of strictly earlier blocks plus the diagonal, counts that make
    whole groups equal: most steps take the no-mask path (Meta.full), the diagonal and the
    mixed groups the masked one; both agree with the reference, forward and gradients."""
    from kernels_pallas.block_sparse_attention import xla

    T, bs, B, H, K, D = 96, 8, 1, 4, 2, 16
    nq = T // bs
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=22)
    seg = jnp.ones((B, T), jnp.int32)
    n = np.arange(nq)[:, None]
    idx = np.broadcast_to(np.maximum(n - np.arange(4), 0), (B, K, nq, 4)).astype(np.int32)
    counts = np.broadcast_to(np.minimum(np.arange(nq) + 1, 4), (B, K, nq)).astype(np.int32)
    idx, counts = jnp.asarray(idx), jnp.asarray(counts)
    meta = xla._metadata(idx, counts, seg, xla.make_sparse_blocks(B, T, H, K, bs, gq=3))
    full = np.asarray(meta.full)  # [groups, slots]
    assert full[:3, :3].all() and not full[:, 3].any() and not full[3].any()
    # segment ids are data (as in training): one program per implementation serves both layouts
    got = jax.jit(lambda seg: _out_and_vjp(
        lambda q, k, v: xla.block_sparse_attention_xla(q, k, v, idx, counts, seg, bs, 3), (q, k, v)
    ))
    want = jax.jit(lambda seg: _out_and_vjp(
        lambda q, k, v: block_sparse_attention(q, k, v, idx, counts, seg, bs, "reference"), (q, k, v)
    ))
    _assert_close(*got(seg), *want(seg), jnp.float32)
    # a second document starting inside block 5 makes every step that touches it masked
    seg2 = jnp.asarray(np.where(np.arange(T) < 44, 1, 2)[None], jnp.int32)
    meta2 = xla._metadata(idx, counts, seg2, xla.make_sparse_blocks(B, T, H, K, bs, gq=3))
    assert np.asarray(meta2.full).sum() < full.sum()
    _assert_close(*got(seg2), *want(seg2), jnp.float32)


@pytest.mark.slow
def test_slots_past_a_blocks_own_count_read_nothing():
    """In one group, query block 7 lists block 6 (valid) while query block 6 lists block 5
    past its count; NaN in block 5's values must not reach block 6's rows, although the group
    runs two steps for both: slots past a block's count read the zero filler block."""
    from kernels_pallas.block_sparse_attention.xla import block_sparse_attention_xla

    T, bs, B, H, K, D = 64, 8, 1, 4, 2, 8
    nq = T // bs
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=23)
    idx = np.zeros((B, K, nq, 2), np.int32)
    idx[..., 0] = np.arange(nq)
    idx[..., 1] = np.maximum(np.arange(nq) - 1, 0)
    counts = np.ones((B, K, nq), np.int32)
    counts[..., 7] = 2
    v_nan = v.at[:, 40:48].set(jnp.nan)  # block 5: selected only by itself (its diagonal)
    f = jax.jit(lambda v: block_sparse_attention_xla(q, k, v, jnp.asarray(idx), jnp.asarray(counts), None, bs, nq))
    out = np.asarray(f(v_nan))
    keep = np.ones(T, bool)
    keep[40:48] = False
    assert np.all(np.isfinite(out[:, keep])), "a slot past its block's count read a listed block"
    want = jax.jit(block_sparse_attention, static_argnums=(6, 7))(
        q, k, v, jnp.asarray(idx), jnp.asarray(counts), None, bs, "reference")
    np.testing.assert_allclose(f(v), want, **tol("attention_out", jnp.float32))
