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

from jaxsb.router import route
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


def test_router_selection_matches_reference_across_budgets():
    """End to end with the router's lists: budgets from the diagonal only to every block."""
    T, bs, B, H, K, D = T_MAIN, 8, 2, 4, 2, 16
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=5)
    seg = _segments(T, SEG_MAIN)
    for budgets in ([1, 1], [2, 5], [10, 10]):
        idx, counts, _ = route(q, k, seg, jnp.asarray(budgets), bs, max_blocks=6)
        run = lambda impl: _out_and_vjp(
            lambda q, k, v: block_sparse_attention(q, k, v, idx, counts, seg, bs, impl), (q, k, v)
        )
        _assert_close(*run("xla"), *run("reference"), jnp.float32)


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


def test_duplicates_count_once_and_empty_rows_are_zero():
    T, bs, B, H, K, D = 32, 8, 1, 2, 1, 8
    q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=8)
    nq = T // bs
    # query block n lists [n, n-1, n, n-1]: duplicates of valid entries
    base = jnp.stack([jnp.arange(nq), jnp.maximum(jnp.arange(nq) - 1, 0)] * 2, -1)
    idx = jnp.broadcast_to(base, (B, K, nq, 4)).astype(jnp.int32)
    counts = jnp.full((B, K, nq), 4, jnp.int32)
    once = jnp.broadcast_to(base[:, :2], (B, K, nq, 2)).astype(jnp.int32)
    got = block_sparse_attention(q, k, v, idx, counts, None, bs, "xla")
    want = block_sparse_attention(q, k, v, once, jnp.full((B, K, nq), 2, jnp.int32), None, bs, "reference")
    np.testing.assert_allclose(got, want, **tol("attention_out", jnp.float32))
    # query block 2 lists only the future block 3: its rows see nothing and output zeros
    idx2 = once.at[:, :, 2, 0].set(3)
    c2 = jnp.full((B, K, nq), 2, jnp.int32).at[:, :, 2].set(1)
    for impl in ("xla", "reference"):
        out = np.asarray(block_sparse_attention(q, k, v, idx2, c2, None, bs, impl))
        np.testing.assert_array_equal(out[0, 16:24], 0.0)


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
    dk = np.asarray(jax.grad(lambda k: (block_sparse_attention(q, k, v, idx, counts, seg, bs) * w5).sum())(k))
    assert np.all(dk[0, :24] == 0.0) and np.any(dk[0, 24:40] != 0.0)


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
