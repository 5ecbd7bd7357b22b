"""Pallas block-sparse attention vs the dense reference: outputs, dQ/dK/dV, list semantics.

One suite, two modes: `TestBlockSparseAttentionPallas` runs the kernels in the Pallas
interpreter (INTERPRET = True, works on CPU); `TestBlockSparseAttentionPallasCompiled` flips
INTERPRET to compile them for the accelerator and is skipped on CPU (see scripts/gpu_check.sh).
Shapes are tiny (T = 150, blocks of 32/64) because the interpreter is slow; they still give a
document over many blocks, a one-token document, several documents per row, padding and a
ragged last block. Host-side table construction is tested separately, without kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import tol
from attention_inputs import out_and_vjp as _out_and_vjp, random_blocks as _random_blocks, random_qkv as _inputs, segments as _segments

from jaxsb.models.router import route
from kernels_pallas import attention_reference, block_sparse_attention
from kernels_pallas.block_sparse_attention import pallas as bsa_pallas


def _assert_close(got, want, dtype):
    (out, grads), (out_ref, grads_ref) = got, want
    assert out.dtype == dtype and out.shape == out_ref.shape
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(out_ref, np.float32), **tol("attention_out", dtype)
    )
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert g.dtype == dtype and g.shape == g_ref.shape, name
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(g_ref, np.float32), err_msg=f"d{name}",
            **tol("attention_grad", dtype),
        )


T_MAIN = 150  # not a multiple of 32 or 64
# Row 0: a 100-token document over many blocks, a one-token document, a 40-token one, then 9
# padding tokens. Row 1: five documents (one of length 1) filling the row.
SEG_MAIN = [[100, 1, 40], [20, 1, 60, 30, 39]]

CASES = [
    # (name, H, K, D, block_size, budgets per row, max_blocks)
    ("gqa1-bs32-diag-only", 4, 4, 16, 32, [1, 1], 5),
    ("gqa2-bs32-mixed", 4, 2, 16, 32, [2, 4], 4),
    ("gqa4-bs64-mixed", 4, 1, 32, 64, [2, 3], 3),
    ("gqa2-bs32-all-d24", 4, 2, 24, 32, [5, 5], 5),  # D padded to 32 inside
]
PARAMS = [pytest.param(c, jnp.float32, id=f"{c[0]}-f32") for c in CASES] + [
    pytest.param(c, jnp.bfloat16, id=f"{c[0]}-bf16")
    for c in CASES
    if c[0] in ("gqa2-bs32-mixed", "gqa4-bs64-mixed")
]


@pytest.mark.slow
class TestBlockSparseAttentionPallas:
    """The kernels through the Pallas interpreter; subclass with INTERPRET = False to compile."""

    INTERPRET = True

    @pytest.fixture(autouse=True)
    def _needs_accelerator(self):
        if not self.INTERPRET and jax.default_backend() == "cpu":
            pytest.skip("compiled Pallas needs a GPU or TPU backend")

    def _sparse(self, idx, counts, seg, bs, impl="pallas"):
        def f(q, k, v):
            kw = {"interpret": self.INTERPRET} if impl == "pallas" else {}
            return block_sparse_attention(q, k, v, idx, counts, seg, bs, impl, **kw)

        return f

    @pytest.mark.parametrize("case, dtype", PARAMS)
    def test_matches_reference(self, case, dtype):
        _, H, K, D, bs, budgets, M = case
        B = len(SEG_MAIN)
        q, k, v = _inputs(B, T_MAIN, H, K, D, dtype)
        seg = _segments(T_MAIN, SEG_MAIN)
        idx, counts = _random_blocks(B, K, -(-T_MAIN // bs), M, budgets, seed=2)
        got = _out_and_vjp(self._sparse(idx, counts, seg, bs), (q, k, v))
        want = _out_and_vjp(self._sparse(idx, counts, seg, bs, "reference"), (q, k, v))
        _assert_close(got, want, dtype)

    @pytest.mark.parametrize("case, tile, dtype", [
        (CASES[1], 16, jnp.float32), (CASES[2], 16, jnp.float32), (CASES[2], 32, jnp.bfloat16),
    ], ids=["bs32-tile16-f32", "bs64-tile16-f32", "bs64-tile32-bf16"])
    def test_sub_tiles_match_reference(self, case, tile, dtype):
        """A routing block split into tiles (as wide ones are on GPU, bsa_pallas.sub_tile)
        computes the same attention and gradients: diagonal blocks skip the
        masked tiles, every other selected block is walked tile by tile."""
        _, H, K, D, bs, budgets, M = case
        B = len(SEG_MAIN)
        q, k, v = _inputs(B, T_MAIN, H, K, D, dtype)
        seg = _segments(T_MAIN, SEG_MAIN)
        idx, counts = _random_blocks(B, K, -(-T_MAIN // bs), M, budgets, seed=2)
        tiled = lambda q, k, v: bsa_pallas.block_sparse_attention_pallas(  # noqa: E731
            q, k, v, idx, counts, seg, bs, self.INTERPRET, tile=tile)
        got = _out_and_vjp(tiled, (q, k, v))
        want = _out_and_vjp(self._sparse(idx, counts, seg, bs, "reference"), (q, k, v))
        _assert_close(got, want, dtype)

    @pytest.mark.parametrize(
        "H, K, docs", [(4, 4, SEG_MAIN), (4, 2, None), (4, 1, SEG_MAIN)],
        ids=["gqa1-docs", "gqa2-one-doc", "gqa4-docs"],
    )
    def test_all_blocks_equals_dense_attention(self, H, K, docs):
        """Every block listed (reversed, future blocks and garbage included): exactly dense
        causal document attention."""
        T, bs, B, D = T_MAIN, 32, 2, 16
        nq = -(-T // bs)
        q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=4)
        seg = None if docs is None else _segments(T, docs)
        row = jnp.concatenate([jnp.arange(nq)[::-1], jnp.array([99, -3], jnp.int32)])
        idx = jnp.broadcast_to(row, (B, K, nq, nq + 2)).astype(jnp.int32)
        counts = jnp.full((B, K, nq), nq, jnp.int32)
        got = _out_and_vjp(self._sparse(idx, counts, seg, bs), (q, k, v))
        want = _out_and_vjp(lambda q, k, v: attention_reference(q, k, v, seg, True), (q, k, v))
        _assert_close(got, want, jnp.float32)

    def test_matches_xla_with_router_lists(self):
        """The router's lists (diagonal first, then by score) give what "xla" gives."""
        T, bs, B, H, K, D = T_MAIN, 32, 2, 4, 2, 16
        q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=5)
        seg = _segments(T, SEG_MAIN)
        idx, counts, _ = route(q, k, seg, jnp.asarray([2, 3]), bs, max_blocks=3)
        got = _out_and_vjp(self._sparse(idx, counts, seg, bs), (q, k, v))
        want = _out_and_vjp(self._sparse(idx, counts, seg, bs, "xla"), (q, k, v))
        _assert_close(got, want, jnp.float32)

    def test_odd_valid_entries(self):
        """Valid entries that repeat, lie outside [0, nq) or in the future: duplicates count
        once, the others select nothing, exactly like the reference and "xla"."""
        T, bs, B, H, K, D = 128, 32, 1, 2, 1, 16
        nq = T // bs
        q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=6)
        seg = _segments(T, [[70, 50]])
        n = jnp.arange(nq)
        prev = jnp.maximum(n - 1, 0)
        rows = jnp.stack([n, n, 0 * n - 1, 0 * n + nq + 2, n + 1, prev, prev], -1)
        idx = jnp.broadcast_to(rows, (B, K, nq, 7)).astype(jnp.int32)
        counts = jnp.full((B, K, nq), 7, jnp.int32)
        got = _out_and_vjp(self._sparse(idx, counts, seg, bs), (q, k, v))
        want = _out_and_vjp(self._sparse(idx, counts, seg, bs, "reference"), (q, k, v))
        _assert_close(got, want, jnp.float32)
        want = _out_and_vjp(self._sparse(idx, counts, seg, bs, "xla"), (q, k, v))
        _assert_close(got, want, jnp.float32)

    def test_garbage_past_counts_is_ignored_and_not_visited(self):
        """Changing the slots past the count changes nothing, bit for bit; and key blocks that
        are listed only past the counts are never read: NaN in their q, k and v stays in their
        own rows (were they visited, 0 * NaN or exp(NaN) would poison every output)."""
        T, bs, B, H, K, D = 128, 32, 1, 4, 2, 16
        nq = T // bs
        q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=7)
        idx, counts = _random_blocks(B, K, nq, 4, [2], seed=8)
        garbage = jnp.where(jnp.arange(4) >= counts[..., None], 12345, idx)
        a = _out_and_vjp(self._sparse(idx, counts, None, bs), (q, k, v))
        b = _out_and_vjp(self._sparse(garbage, counts, None, bs), (q, k, v))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(x, y)

        # every query block lists only itself; the garbage slots all name block 1
        idx = jnp.full((B, K, nq, 4), 1, jnp.int32).at[..., 0].set(jnp.arange(nq))
        counts = jnp.ones((B, K, nq), jnp.int32)
        poisoned = (np.arange(T) >= bs) & (np.arange(T) < 2 * bs)
        mask = jnp.asarray(poisoned)[None, :, None, None]
        q, k, v = (jnp.where(mask, jnp.nan, x) for x in (q, k, v))
        out, grads = _out_and_vjp(self._sparse(idx, counts, None, bs), (q, k, v))
        for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
            x = np.asarray(x)
            assert np.all(np.isfinite(x[0, ~poisoned])), f"{name}: an unlisted block was read"
            assert np.all(np.isnan(x[0, poisoned])), f"{name}: the poison did not arrive"

    def test_rows_that_see_nothing_are_zero(self):
        """Count 0, or only a future block: output 0 and no gradient, no NaN."""
        T, bs, B, H, K, D = 128, 32, 1, 2, 1, 16
        nq = T // bs
        q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=9)
        idx = jnp.broadcast_to(jnp.arange(nq)[:, None], (B, K, nq, 2)).astype(jnp.int32)
        idx = idx.at[:, :, 2, 0].set(3)  # block 2 lists only the future block 3
        counts = jnp.ones((B, K, nq), jnp.int32).at[:, :, 1].set(0)  # block 1 lists nothing
        out, (dq, dk, dv) = _out_and_vjp(self._sparse(idx, counts, None, bs), (q, k, v))
        empty = slice(bs, 3 * bs)
        np.testing.assert_array_equal(np.asarray(out)[0, empty], 0.0)
        np.testing.assert_array_equal(np.asarray(dq)[0, empty], 0.0)
        # blocks 1 and 2 are selected by nobody: their keys get no gradient
        np.testing.assert_array_equal(np.asarray(dk)[0, empty], 0.0)
        np.testing.assert_array_equal(np.asarray(dv)[0, empty], 0.0)
        want = _out_and_vjp(self._sparse(idx, counts, None, bs, "reference"), (q, k, v))
        _assert_close((out, (dq, dk, dv)), want, jnp.float32)

    def test_no_information_crosses_documents(self):
        """d(outputs of document 2) / d(q, k, v of any other token) is exactly zero even though
        every block is listed."""
        T, bs, B, H, K, D = 128, 32, 1, 4, 2, 16
        nq = T // bs
        seg = _segments(T, [[30, 70, 20]])  # doc 2 spans blocks 0..3, then padding
        q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=10)
        idx = jnp.broadcast_to(jnp.arange(nq), (B, K, nq, nq)).astype(jnp.int32)
        counts = jnp.full((B, K, nq), nq, jnp.int32)
        in_doc = np.asarray(seg[0]) == 2
        w = np.random.default_rng(11).normal(size=(B, T, H, D)) * in_doc[None, :, None, None]
        f = self._sparse(idx, counts, seg, bs)
        loss = lambda q, k, v: (f(q, k, v) * jnp.asarray(w, jnp.float32)).sum()  # noqa: E731
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for name, g in zip("qkv", grads):
            g = np.asarray(g)
            assert np.all(g[0, ~in_doc] == 0.0), f"d{name} leaks outside document 2"
            assert np.any(g[0, in_doc] != 0.0), f"d{name} is zero inside document 2"

    def test_traced_counts_one_compilation(self):
        """Lists and counts are data: one compiled program serves every budget."""
        T, bs, B, H, K, D = 96, 32, 2, 2, 1, 16
        q, k, v = _inputs(B, T, H, K, D, jnp.float32, seed=12)
        seg = _segments(T, [[40, 56], [96]])
        f = jax.jit(
            lambda idx, c: block_sparse_attention(
                q, k, v, idx, c, seg, bs, "pallas", interpret=self.INTERPRET
            )
        )
        for budgets in ([1, 3], [2, 1]):
            idx, counts = _random_blocks(B, K, 3, 3, budgets, seed=13)
            want = block_sparse_attention(q, k, v, idx, counts, seg, bs, "reference")
            np.testing.assert_allclose(f(idx, counts), want, **tol("attention_out", jnp.float32))
        assert f._cache_size() == 1


@pytest.mark.compiled
class TestBlockSparseAttentionPallasCompiled(TestBlockSparseAttentionPallas):
    INTERPRET = False


# ------------------------------------------------------------------ host-side logic (CPU only)


def test_block_tables_match_a_brute_force():
    """fwd rows: count, then the distinct valid in-range non-future entries ascending; bwd rows:
    the same relation transposed (which query blocks selected each key block)."""
    rng = np.random.default_rng(14)
    B, K, nq, M = 2, 3, 6, 5
    idx = rng.integers(-3, nq + 3, size=(B, K, nq, M)).astype(np.int32)
    counts = rng.integers(-1, M + 2, size=(B, K, nq)).astype(np.int32)
    tables = bsa_pallas.block_tables(jnp.asarray(idx), jnp.asarray(counts), nq)
    fwd, bwd = (np.asarray(t) for t in tables)
    assert fwd.shape == (B, K, nq, 1 + M) and bwd.shape == (B, K, nq, 1 + nq)
    sel = np.zeros((B, K, nq, nq), bool)
    for b in range(B):
        for k in range(K):
            for n in range(nq):
                listed = idx[b, k, n, : max(counts[b, k, n], 0)]
                chosen = sorted({int(j) for j in listed if 0 <= j <= n})
                sel[b, k, n, chosen] = True
                assert fwd[b, k, n, 0] == len(chosen)
                assert list(fwd[b, k, n, 1 : 1 + len(chosen)]) == chosen
    for b in range(B):
        for k in range(K):
            for j in range(nq):
                qs = list(np.nonzero(sel[b, k, :, j])[0])
                assert bwd[b, k, j, 0] == len(qs)
                assert list(bwd[b, k, j, 1 : 1 + len(qs)]) == qs
    assert sel.sum() > 0 and (~sel).sum() > 0


@pytest.mark.parametrize("n, width", [(40, 12), (3000, 400)], ids=["compare-all", "binary-search"])
def test_true_positions_match_numpy(n, width):
    """Both ways `true_positions` searches (every rank against every entry for small tables, a
    binary search for large ones) give numpy's positions of the True entries, ascending, and
    the axis length past the last one."""
    rng = np.random.default_rng(n)
    mask = rng.random((3, 2, n)) < rng.choice([0.0, 0.05, 0.5], size=(3, 2, 1))
    pos, count = (np.asarray(x) for x in bsa_pallas.true_positions(jnp.asarray(mask), width))
    assert pos.shape == (3, 2, width) and pos.dtype == np.int32
    for row, got, c in zip(mask.reshape(-1, n), pos.reshape(-1, width), count.reshape(-1)):
        want = np.nonzero(row)[0][:width]
        assert c == row.sum()
        assert list(got[: len(want)]) == list(want) and (got[len(want):] == n).all()
    assert count.min() == 0 and count.max() > width


def test_dispatch():
    """"pallas" reaches the kernels (interpreted on CPU); "auto" is "xla" on CPU; compiled
    Pallas on CPU is refused with a clear message; compiled blocks must be powers of two."""
    T, bs = 64, 32
    q, k, v = _inputs(1, T, 2, 1, 16, jnp.float32)
    idx = jnp.zeros((1, 1, 2, 2), jnp.int32).at[..., 0].set(jnp.arange(2))
    counts = jnp.full((1, 1, 2), 2, jnp.int32)
    f = lambda impl, **kw: (  # noqa: E731
        lambda q: block_sparse_attention(q, k, v, idx, counts, None, bs, impl, **kw)
    )
    assert "pallas_call" in str(jax.make_jaxpr(f("pallas"))(q))
    if jax.default_backend() == "cpu":
        assert "pallas_call" not in str(jax.make_jaxpr(f("auto"))(q))
        with pytest.raises(ValueError, match="interpret=True"):
            f("pallas", interpret=False)(q)
    with pytest.raises(ValueError, match="block_size=24"):
        bsa_pallas.make_sparse_triton_blocks(75, 16, 24, interpret=False)
    with pytest.raises(ValueError, match="tile=48 must divide block_size=64"):
        bsa_pallas.make_sparse_triton_blocks(75, 16, 64, interpret=False, tile=48)


def test_tiles_stay_within_max_tile_bytes():
    """A routing block splits into power-of-two tiles of at most MAX_TILE_BYTES (a 128 x 128 or
    64 x 128 float32 tile exceeds H100's and A100's shared memory; a 128 x 128 bf16 tile compiles
    slowly), never below 16 rows."""
    assert [bsa_pallas.sub_tile(bs, 2, 64) for bs in (16, 64, 128, 256)] == [16, 64, 128, 128]
    assert [bsa_pallas.sub_tile(bs, 2, 128) for bs in (16, 64, 128, 256)] == [16, 64, 64, 64]
    assert [bsa_pallas.sub_tile(bs, 4, 64) for bs in (16, 64, 128, 256)] == [16, 64, 64, 64]
    assert [bsa_pallas.sub_tile(bs, 4, 128) for bs in (16, 64, 128, 256)] == [16, 32, 32, 32]
    assert bsa_pallas.sub_tile(128, 4, 512) == 16 and bsa_pallas.sub_tile(24, 4, 256) == 24  # interpreter-only blocks
    blocks = bsa_pallas.make_sparse_triton_blocks(300, 64, 128, interpret=False, tile=64)
    assert (blocks.nb, blocks.nsub, blocks.Tp) == (3, 2, 384)


@pytest.mark.compiled
def test_compiled_kernels_lower_to_triton_for_gpu():
    """Forward, dQ and dK/dV lower through Pallas' Triton path for CUDA, checked on any host by
    exporting for the "cuda" platform (no GPU needed; compiling the Triton IR still is)."""
    from jax import export

    B, T, H, K, D, bs, M = 1, 256, 4, 2, 64, 64, 2
    nq = T // bs
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    idx = jax.ShapeDtypeStruct((B, K, nq, M), jnp.int32)
    counts = jax.ShapeDtypeStruct((B, K, nq), jnp.int32)

    def loss(q, k, v, s, idx, counts):
        # the kernel entry itself: ops refuses interpret=False on a CPU host
        out = bsa_pallas.block_sparse_attention_pallas(q, k, v, idx, counts, s, bs, False)
        return out.astype(jnp.float32).sum()

    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(
        fwd_bwd, platforms=("cuda",),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
    )(q, kv, kv, seg, idx, counts)
    module = exported.mlir_module()
    assert module.count(f"@{triton}") >= 3, "expected the forward, dQ and dK/dV Triton kernels"
