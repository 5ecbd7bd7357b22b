"""Pallas flash attention vs the dense reference: outputs, dQ/dK/dV, masking, work skipping.

One suite, two modes: `TestFlashAttentionPallas` runs the kernels in the Pallas interpreter
(INTERPRET = True, works on CPU); `TestFlashAttentionPallasCompiled` flips INTERPRET to compile
them for the accelerator and is skipped when the backend is CPU (see scripts/gpu_check.sh).
Shapes are tiny (T = 75, blocks 16/32) because the interpreter is slow; they still give many
blocks, documents straddling blocks, a one-token document, padding and a ragged last block.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import tol
from attention_inputs import out_and_vjp as _out_and_vjp, random_qkv as _inputs, segments as _segments

from kernels_pallas import attention_reference, flash_attention
from kernels_pallas.flash_attention import pallas as flash_pallas
from kernels_pallas.flash_attention.reference import attention_mask


# Row 0: a 50-token document spanning several blocks, a one-token document, a 20-token one,
# then 4 padding tokens. Row 1: five documents (one of length 1) filling the row.
T_MAIN = 75  # not a multiple of any block size below
SEG_MAIN = [[50, 1, 20], [7, 1, 30, 12, 25]]

CASES = [
    # (name, H, K, D, causal, block_q, block_k, segments)
    ("gqa1-causal-16x16", 4, 4, 16, True, 16, 16, SEG_MAIN),
    ("gqa2-causal-32x16", 4, 2, 16, True, 32, 16, SEG_MAIN),
    ("gqa4-causal-16x32", 4, 1, 16, True, 16, 32, SEG_MAIN),
    ("gqa2-noncausal-16x32", 4, 2, 16, False, 16, 32, SEG_MAIN),
    ("gqa1-causal-nosegments-d32", 2, 2, 32, True, 32, 16, None),
    ("gqa2-causal-d24-block>T", 4, 2, 24, True, 256, 256, SEG_MAIN),  # D padded to 32
    # one row whose padding fills whole blocks (per-row tables must not hide a row's bug)
    ("gqa2-causal-padding-heavy", 4, 2, 16, True, 16, 16, [[40, 1, 10]]),
]

PARAMS = [pytest.param(c, jnp.float32, id=f"{c[0]}-f32") for c in CASES] + [
    pytest.param(c, jnp.bfloat16, id=f"{c[0]}-bf16")
    for c in CASES
    if c[0] in ("gqa2-causal-32x16", "gqa4-causal-16x32")
]


@pytest.mark.slow
class TestFlashAttentionPallas:
    """The kernels through the Pallas interpreter; subclass with INTERPRET = False to compile."""

    INTERPRET = True

    @pytest.fixture(autouse=True)
    def _needs_accelerator(self):
        if not self.INTERPRET and jax.default_backend() == "cpu":
            pytest.skip("compiled Pallas needs a GPU or TPU backend")

    def _flash(self, seg, causal, bq, bk):
        def flash(q, k, v):
            return flash_attention(
                q, k, v, seg, causal, "pallas", block_q=bq, block_k=bk, interpret=self.INTERPRET
            )

        return flash

    @pytest.mark.parametrize("case, dtype", PARAMS)
    def test_matches_reference(self, case, dtype):
        _, H, K, D, causal, bq, bk, docs = case
        B = 2 if docs is None else len(docs)
        q, k, v = _inputs(B, T_MAIN, H, K, D, dtype)
        seg = None if docs is None else _segments(T_MAIN, docs)

        out, grads = _out_and_vjp(self._flash(seg, causal, bq, bk), (q, k, v))
        out_ref, grads_ref = _out_and_vjp(
            lambda q, k, v: attention_reference(q, k, v, seg, causal), (q, k, v)
        )
        assert out.dtype == dtype and out.shape == q.shape
        np.testing.assert_allclose(
            np.asarray(out, np.float32),
            np.asarray(out_ref, np.float32),
            **tol("attention_out", dtype),
        )
        for name, g, g_ref, x in zip("qkv", grads, grads_ref, (q, k, v)):
            assert g.dtype == dtype and g.shape == x.shape, name
            np.testing.assert_allclose(
                np.asarray(g, np.float32),
                np.asarray(g_ref, np.float32),
                err_msg=f"d{name}",
                **tol("attention_grad", dtype),
            )

    def test_no_information_crosses_documents(self):
        """d(outputs of document 2) / d(q, k, v of any other token) is exactly zero."""
        T = 60
        seg = _segments(T, [[20, 25, 10]])  # documents 1, 2, 3 then 5 padding tokens
        q, k, v = _inputs(1, T, 4, 2, 16, jnp.float32, seed=5)
        in_doc = np.asarray(seg[0]) == 2
        weights = jnp.asarray(np.random.default_rng(6).normal(size=(1, T, 4, 16)), jnp.float32)
        weights = weights * jnp.asarray(in_doc)[None, :, None, None]
        flash = self._flash(seg, True, 16, 16)

        grads = jax.jit(jax.grad(lambda *a: (flash(*a) * weights).sum(), argnums=(0, 1, 2)))(
            q, k, v
        )
        for name, g in zip("qkv", grads):
            g = np.asarray(g)
            assert np.all(g[0, ~in_doc] == 0.0), f"d{name} leaks outside document 2"
            assert np.any(g[0, in_doc] != 0.0), f"d{name} is zero inside document 2"

    @pytest.mark.parametrize(
        "layout",
        [
            # packed: block 0 is document 1 only; blocks 2-3 hold documents 2, 3 and padding,
            # so block 0 lies outside their loop ranges
            ("range", [1] * 20 + [2] * 25 + [3] * 10 + [0] * 9, (0, 16), (32, 64)),
            # id 1 comes back after document 2: query block 3 visits key blocks 0..3 and the
            # per-pair kind must skip blocks 1-2 in the middle of that range
            ("interior", [1] * 16 + [2] * 32 + [1] * 16, (16, 48), (48, 64)),
        ],
        ids=lambda layout: layout[0],
    )
    def test_skipped_blocks_are_not_read(self, layout):
        """Skipped, not just masked: NaN in every input of the poisoned tokens must not reach
        blocks that share no document with them (a masked product 0 * NaN is still NaN)."""
        _, ids, (p0, p1), (c0, c1) = layout  # poisoned and clean token ranges
        T = len(ids)
        seg = jnp.asarray([ids], jnp.int32)
        q, k, v = _inputs(1, T, 4, 2, 16, jnp.float32, seed=8)
        poisoned = (np.arange(T) >= p0) & (np.arange(T) < p1)
        clean = (np.arange(T) >= c0) & (np.arange(T) < c1)
        mask = jnp.asarray(poisoned)[None, :, None, None]
        q, k, v = (jnp.where(mask, jnp.nan, x) for x in (q, k, v))
        out, grads = _out_and_vjp(self._flash(seg, True, 16, 16), (q, k, v))
        for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
            x = np.asarray(x)
            assert np.all(np.isfinite(x[0, clean])), f"{name}: a skipped block was computed"
            assert np.all(np.isnan(x[0, poisoned])), f"{name}: the poison did not arrive"

    def test_padded_keys_get_no_mass(self):
        """Non-causal, T not a multiple of block_k: every query could reach padded keys."""
        T = 21
        q, k, v = _inputs(1, T, 2, 2, 16, jnp.float32, seed=7)
        out = jax.jit(self._flash(None, False, 16, 16))(q, k, v)
        ref = attention_reference(q, k, v, None, False)
        np.testing.assert_allclose(out, ref, **tol("attention_out", jnp.float32))


@pytest.mark.compiled
class TestFlashAttentionPallasCompiled(TestFlashAttentionPallas):
    INTERPRET = False


# ------------------------------------------------------------------ host-side logic (CPU only)


def test_block_tables_are_conservative_and_skip():
    """Pairs with an allowed entry are visited; FULL pairs are entirely allowed; per row, the
    visited ranges cover every non-SKIP pair; and pairs with nothing allowed are skipped."""
    T, bq, bk = 96, 16, 8
    seg = _segments(T, [[40, 1, 30], [8, 8, 50, 30], [96]])
    B = seg.shape[0]
    for causal in (True, False):
        blocking = flash_pallas.make_flash_triton_blocks(T, 16, causal, bq, bk, interpret=True)
        tables = flash_pallas.block_tables(seg, seg, blocking)
        kinds, k_range, q_range = (np.asarray(x) for x in tables)
        assert kinds.shape == (B, blocking.nq, blocking.nk)
        blocks = np.asarray(attention_mask(seg, T, causal, B)).reshape(
            B, blocking.nq, bq, blocking.nk, bk)
        any_b, all_b = blocks.any(axis=(2, 4)), blocks.all(axis=(2, 4))
        assert np.all(kinds[any_b] != flash_pallas.SKIP), causal
        assert np.all(all_b[kinds == flash_pallas.FULL]), causal
        if not causal:  # tight for packed rows (causal adds the diagonal's triangle)
            assert np.all(kinds[~any_b] == flash_pallas.SKIP)
        assert (kinds == flash_pallas.FULL).sum() > 0, causal
        ki, qi = np.arange(blocking.nk), np.arange(blocking.nq)
        for b in range(B):
            for i in range(blocking.nq):
                lo, hi = k_range[b, i]
                assert np.all(kinds[b, i, (ki < lo) | (ki >= hi)] == flash_pallas.SKIP)
            for j in range(blocking.nk):
                lo, hi = q_range[b, j]
                assert np.all(kinds[b, (qi < lo) | (qi >= hi), j] == flash_pallas.SKIP)
        if causal:  # above the diagonal is outside every query block's range
            assert np.all(k_range[:, :, 1] <= (qi + 1) * bq // bk + 1)
    # the row of one 96-token document visits everything causal; the packed rows skip work
    blocking = flash_pallas.make_flash_triton_blocks(T, 16, True, bq, bk, interpret=True)
    kinds = np.asarray(flash_pallas.block_tables(seg, seg, blocking)[0])
    visited = (kinds != flash_pallas.SKIP).sum(axis=(1, 2))
    assert visited[0] < visited[2] and visited[1] < visited[2], visited


def test_dispatch():
    """"pallas" reaches the kernels (interpreted on CPU); "auto" is "xla" on CPU; compiled
    Pallas on CPU is refused with a clear message."""
    q, k, v = _inputs(1, 40, 4, 2, 16, jnp.float32)
    seg = _segments(40, [[10, 30]])
    ref = attention_reference(q, k, v, seg)
    out = flash_attention(q, k, v, seg, implementation="pallas", block_q=16, block_k=16)
    np.testing.assert_allclose(out, ref, **tol("attention_out", jnp.float32))
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="interpret=True"):
            flash_attention(q, k, v, seg, implementation="pallas", interpret=False)
        jaxpr = str(jax.make_jaxpr(lambda q: flash_attention(q, k, v, seg, block_q=16))(q))
        assert "pallas_call" not in jaxpr


def test_compiled_blocks_must_be_powers_of_two():
    with pytest.raises(ValueError, match="block_q=24"):
        flash_pallas.make_flash_triton_blocks(75, 16, True, 24, 16, interpret=False)


@pytest.mark.compiled
def test_compiled_kernels_lower_to_triton_for_gpu():
    """Forward and backward lower through Pallas' Triton path for CUDA, checked on any host by
    exporting for the "cuda" platform (no GPU needed; compiling the Triton IR still is)."""
    from jax import export

    B, T, H, K, D = 1, 256, 4, 2, 64
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(q, k, v, s):
        # the kernel entry itself: ops.flash_attention refuses interpret=False on a CPU host
        out = flash_pallas.flash_attention_pallas(q, k, v, s, True, 128, 64, False)
        return out.astype(jnp.float32).sum()

    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(fwd_bwd, platforms=("cuda",),
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(q, kv, kv, seg)
    module = exported.mlir_module()
    assert module.count(f"@{triton}") >= 3, "expected the forward, dQ and dK/dV Triton kernels"
